"""Errors raised by the bootstrap's state, each carrying the gRPC status the caller receives."""

from __future__ import annotations

import grpc


class BootstrapError(Exception):
    """A refused request; the message says what was wrong and what to do."""

    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(BootstrapError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(BootstrapError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(BootstrapError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(BootstrapError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(BootstrapError):
    code = grpc.StatusCode.PERMISSION_DENIED
