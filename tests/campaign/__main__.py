import sys

from tests.campaign.campaign import main

sys.exit(main())
