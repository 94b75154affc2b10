from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from sqllocker.django import locked


@locked("report {day}", on_busy="conflict")
def report(request: HttpRequest, day: str) -> HttpResponse:
    return HttpResponse(f"report {day}")
