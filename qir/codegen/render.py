"""The one Jinja environment. Templates only substitute and loop; any missing variable is an
error (StrictUndefined) rather than an empty string in the CUDA."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import jinja2

TEMPLATES = resources.files("qir.codegen") / "templates"
COMMON_HEADER = "qir_common.cuh"


@cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render(template: str, **context: Any) -> str:
    return environment().get_template(template).render(**context)


@cache
def common_header() -> tuple[str, str]:
    return COMMON_HEADER, (TEMPLATES / COMMON_HEADER).read_text()
