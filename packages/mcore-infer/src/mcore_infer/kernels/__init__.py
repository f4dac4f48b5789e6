"""Triton kernels of small decode steps (a few rows per weight matrix), used by :mod:`mcore_infer.decode`.

- :mod:`~mcore_infer.kernels.norm_linear`: the residual add, RMSNorm, a linear layer and (optionally) SwiGLU in one
  kernel, for steps of at most :data:`~mcore_infer.kernels.norm_linear.MAX_ROWS` tokens;
- :mod:`~mcore_infer.kernels.small_gemv`: the split-K weight-streaming GEMV of at most
  :data:`~mcore_infer.kernels.small_gemv.FMA_MAX_ROWS` rows (SwiGLU folded into the down projection's loads, the
  output projection as partial sums, the QKV projection summed) and ``add_deferred``, which sums partials;
- :mod:`~mcore_infer.kernels.argmax`: the greedy draw's argmax of each row as one kernel;
- :mod:`~mcore_infer.kernels.fused_mlp`: a gated MLP of at most ``FMA_MAX_ROWS`` rows (up projection, SwiGLU, down
  projection) as one kernel, and the fixed-order sum of its partials.

Every entry point takes an optional ``launch`` (:class:`NormLinearLaunch` / :class:`GemvLaunch` / :class:`MlpLaunch`,
exported here);
None is the kernel's heuristic. Each is a custom op that computes the same with PyTorch ops where Triton cannot run
(the CPU outside ``TRITON_INTERPRET=1``).
"""

from mcore_infer.kernels.fused_mlp import MlpLaunch
from mcore_infer.kernels.norm_linear import Launch as NormLinearLaunch
from mcore_infer.kernels.small_gemv import Launch as GemvLaunch

__all__ = ["GemvLaunch", "MlpLaunch", "NormLinearLaunch"]
