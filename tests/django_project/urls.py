from __future__ import annotations

from django.urls import path

from tests.django_project.reports.views import (
    ReportMethodView,
    ReportView,
    non_atomic_report,
    report,
)

urlpatterns = [
    path("reports/non-atomic/<str:day>", non_atomic_report),
    path("reports/class/<str:day>", ReportView.as_view()),
    path("reports/method/<str:day>", ReportMethodView.as_view()),
    path("reports/<str:day>", report),
]
