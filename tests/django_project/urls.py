from __future__ import annotations

from django.urls import path

from tests.django_project.reports.views import (
    AsyncReportView,
    ReportMethodView,
    ReportView,
    framework_report,
    non_atomic_report,
    rendered_report,
    report,
    streamed_report,
)

urlpatterns = [
    path("reports/non-atomic/<str:day>", non_atomic_report),
    path("reports/class/<str:day>", ReportView.as_view()),
    path("reports/method/<str:day>", ReportMethodView.as_view()),
    path("reports/async/<str:day>", AsyncReportView.as_view()),
    path("reports/streamed/<str:day>", streamed_report),
    path("reports/rendered/<str:day>", rendered_report),
    path("reports/framework/<str:day>", framework_report),
    path("reports/<str:day>", report),
]
