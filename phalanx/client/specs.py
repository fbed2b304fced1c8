"""A gang spec as the SDK takes it (``SpecLike``: a GangSpec, its protobuf, a
mapping or YAML text), checked locally before anything is sent
(``to_spec``), and its YAML form (``spec_yaml``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from phalanx.spec import FieldError, GangSpec, InvalidSpec, load_spec, parse_spec
from phalanx.v1 import types_pb2 as pb
from phalanx.wire import spec_from_pb

SpecLike = GangSpec | pb.GangSpec | Mapping[str, Any] | str


def to_spec(spec: SpecLike) -> GangSpec:
    """Validate locally whatever the caller handed us. Raises InvalidSpec."""
    if isinstance(spec, GangSpec):
        # Re-validate: a dataclass can be built by hand, bypassing parse_spec.
        return parse_spec(spec.to_dict())
    if isinstance(spec, pb.GangSpec):
        return spec_from_pb(spec)
    if isinstance(spec, str):
        return load_spec(spec)
    if isinstance(spec, Mapping):
        return parse_spec(spec)
    raise InvalidSpec([FieldError("spec", f"must be a GangSpec, a mapping or YAML text, got {type(spec).__name__}")])


def spec_yaml(spec: GangSpec) -> str:
    """The YAML form of a validated spec (used by ``phalanx submit -o yaml``)."""
    return yaml.safe_dump(spec.to_dict(), sort_keys=False)
