"""A configuration dataclass saved as a plain dict (checkpoints, exports) and read back with its keys checked."""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from . import _validate as validate

C = TypeVar("C", bound="SavedConfig")


class SavedConfig:
    """``to_dict()`` gives every field; ``from_dict`` refuses a key that is not one (missing ones take their
    defaults, so a config saved before a field was added still loads)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        return validate.config_from_dict(cls, values)
