from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

from django.db import transaction
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.template.response import SimpleTemplateResponse
from django.utils.decorators import method_decorator
from django.views import View

from sqllocker.django import locked


@locked("report {day}", on_busy="conflict")
def report(request: HttpRequest, day: str) -> HttpResponse:
    return HttpResponse(f"report {day}")


@transaction.non_atomic_requests
@locked("report {day}", on_busy="conflict")
def non_atomic_report(request: HttpRequest, day: str) -> HttpResponse:
    """As ``report``, for a project under ATOMIC_REQUESTS: its lock outside the transaction."""
    return HttpResponse(f"report {day}")


@method_decorator(locked("report {day}", on_busy="conflict"), name="dispatch")
class ReportView(View):
    """As ``report``, a class-based view locked around its ``dispatch``: the template's field is
    one of the URL's values, which ``dispatch`` takes in its ``**kwargs``."""

    def get(self, request: HttpRequest, day: str) -> HttpResponse:
        return HttpResponse(f"report {day}")


class ReportMethodView(View):
    """As ``report``, its ``get`` locked by ``method_decorator``."""

    @method_decorator(locked("report {day}", on_busy="conflict"))
    def get(self, request: HttpRequest, day: str) -> HttpResponse:
        return HttpResponse(f"report {day}")


@method_decorator(locked("report {day}", on_busy="conflict"), name="dispatch")
class AsyncReportView(View):
    """An async view under a lock around ``dispatch``, which returns the handler's coroutine
    unrun: refused at the call (its body would run after the release)."""

    async def get(self, request: HttpRequest, day: str) -> HttpResponse:
        return HttpResponse(f"report {day}")


@locked("report {day}", on_busy="conflict")
def streamed_report(request: HttpRequest, day: str) -> StreamingHttpResponse:
    """A streaming response's content is made as it is sent, after the release: refused."""

    def lines() -> Iterator[str]:
        yield f"report {day}"

    return StreamingHttpResponse(lines())


class _HeldWhileRendered:
    """A template whose rendering says whether the view's lock is held then."""

    def render(self, context: object = None, request: object = None) -> str:
        from sqllocker.django import get_locker

        return f"held while rendered: {get_locker().lock_info('report x') is not None}"


@locked("report {day}", on_busy="conflict")
def rendered_report(request: HttpRequest, day: str) -> SimpleTemplateResponse:
    """A template response, which Django renders after the view returns: rendered under the
    lock instead."""
    return SimpleTemplateResponse(_HeldWhileRendered())


class _FinishedByItsFramework(SimpleTemplateResponse):
    """As Django REST framework's ``Response``: no template, and how to render it is set by
    the framework's code once the view returns (``finishing``)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.finished: str | None = None

    @property
    def rendered_content(self) -> str:
        assert self.finished is not None, "rendered before its framework finished it"
        return self.finished


def finishing(view: Callable[..., _FinishedByItsFramework]) -> Callable[..., HttpResponse]:
    """As DRF's ``@api_view`` around a view: finishes the response the view returned."""

    @functools.wraps(view)
    def finish(request: HttpRequest, day: str) -> HttpResponse:
        response = view(request, day)
        response.finished = f"report {day}"
        return response

    return finish


@finishing
@locked("report {day}", on_busy="conflict")
def framework_report(request: HttpRequest, day: str) -> _FinishedByItsFramework:
    return _FinishedByItsFramework()
