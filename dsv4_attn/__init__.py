"""dsv4_attn: DeepSeek-V4 sparse MLA attention (SWA + compressed scopes + sink) on every vendor.

Public face: :class:`SparseMLA` (plan once per step, forward per layer, explain), the data
model (:class:`ModelSpec` and its :class:`Layer` list, a step as :class:`StepBatch` (block tables)
or :class:`StepRows` (ready-made rows: :class:`GlobalRows`, :class:`TopkTable`), :class:`LayerKind` =
(compression ratio, :class:`Selection`), :class:`KVFormat` and the :class:`Record` of each cache),
the platform :func:`probe`, and the :func:`backend` override context manager. To build inputs:
:func:`new_cache` and :func:`insert` (allocate and fill a cache in any record), :func:`gather`
(read rows back), and :mod:`reference` (``reference.sparse_mla``: the float64 golden model every
backend is checked against). ``examples/run_step.py`` puts them together.
"""

from .api import SparseMLA, backend_names
from .common import reference
from .common.backend import Backend, BackendUnavailableError, LayerInputs, Phase
from .common.batch import StepBatch
from .common.layout import Fp8Dialect, KVFormat, Record, gather, insert, new_cache
from .common.plan import StepPlan
from .common.platform import Platform, probe
from .common.registry import backend, register_backend
from .common.rows import GlobalRows, StepRows, TopkTable
from .common.spec import V4_KINDS, Layer, LayerKind, ModelSpec, Selection

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "Fp8Dialect",
    "GlobalRows",
    "KVFormat",
    "Layer",
    "LayerInputs",
    "LayerKind",
    "ModelSpec",
    "Phase",
    "Platform",
    "Record",
    "Selection",
    "SparseMLA",
    "StepBatch",
    "StepPlan",
    "StepRows",
    "TopkTable",
    "V4_KINDS",
    "backend",
    "backend_names",
    "gather",
    "insert",
    "new_cache",
    "probe",
    "reference",
    "register_backend",
]
