from __future__ import annotations

from django.urls import path

from tests.django_project.reports.views import non_atomic_report, report

urlpatterns = [
    path("reports/non-atomic/<str:day>", non_atomic_report),
    path("reports/<str:day>", report),
]
