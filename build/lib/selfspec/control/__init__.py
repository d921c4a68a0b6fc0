"""One decision layer, owned by the engine: arm choice, acceptance and cost models, merge and sizing."""

from .acceptance import AcceptanceModel, temperature_bucket
from .controller import ControlConfig, Controller
from .cost import CostModel, verify_curve

__all__ = ["AcceptanceModel", "ControlConfig", "Controller", "CostModel", "temperature_bucket", "verify_curve"]
