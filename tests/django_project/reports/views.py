from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, HttpResponse

from sqllocker.django import locked


@locked("report {day}", on_busy="conflict")
def report(request: HttpRequest, day: str) -> HttpResponse:
    return HttpResponse(f"report {day}")


@transaction.non_atomic_requests
@locked("report {day}", on_busy="conflict")
def non_atomic_report(request: HttpRequest, day: str) -> HttpResponse:
    """As ``report``, for a project under ATOMIC_REQUESTS: its lock outside the transaction."""
    return HttpResponse(f"report {day}")
