"""Megatron-LM checkpoints: import (``torch_dist`` and legacy, any tp/pp/ep) and export (``torch_dist``).

>>> from mcore_export.megatron import import_megatron, export_megatron
>>> import_megatron("megatron_run/checkpoints", "ckpts/from-megatron")  # doctest: +SKIP
"""

from mcore_export.megatron._unpickle import MegatronFormatError
from mcore_export.megatron.exporter import export_megatron
from mcore_export.megatron.importer import import_megatron, megatron_config

__all__ = ["import_megatron", "export_megatron", "megatron_config", "MegatronFormatError"]
