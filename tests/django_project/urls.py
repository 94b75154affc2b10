from __future__ import annotations

from django.urls import path

from tests.django_project.reports.views import report

urlpatterns = [path("reports/<str:day>", report)]
