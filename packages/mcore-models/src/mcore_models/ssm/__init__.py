"""Mamba-2 (SSD) mixers: the chunked scan (:mod:`.ssd`), the mixer (:mod:`.mixer`) and its layer (:mod:`.layer`)."""

from mcore_models.ssm.layer import MambaLayer
from mcore_models.ssm.mixer import Mamba2Mixer
from mcore_models.ssm.ssd import ssd_reference, ssd_scan

__all__ = ["ssd_scan", "ssd_reference", "Mamba2Mixer", "MambaLayer"]
