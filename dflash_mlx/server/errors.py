"""Errors every protocol answers in OpenAI's shape (the one editors and SDKs parse)."""

from __future__ import annotations

from typing import Dict, Optional


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None,
                 headers: Optional[Dict[str, str]] = None):
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers


def error_body(message: str, kind: str, param=None, code=None) -> Dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
