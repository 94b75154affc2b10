from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies = []  # type: ignore[var-annotated]  # noqa: RUF012
    operations = [  # noqa: RUF012
        migrations.CreateModel(
            name="Entry",
            fields=[
                ("id", models.AutoField(primary_key=True, serialize=False)),
                ("text", models.CharField(max_length=100)),
            ],
        )
    ]
