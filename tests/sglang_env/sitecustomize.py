"""Installed into the SGLang test venv by ci/sglang-tests.sh (nowhere else).

SGLang imports torchvision for image constants only. PyPI's torchvision is built against CUDA
torch; beside a CPU build of torch its C++ ops do not load, and torchvision then fails at import
registering fake kernels for two ops it does not guard ("operator torchvision::nms does not
exist"). Declaring those two op schemas (no kernels) before torchvision loads lets its Python
package import; nothing in these tests calls a torchvision op.
"""

import importlib.abc
import sys


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            if torch.version.cuda is None:
                for op in ("nms", "qnms"):
                    torch.library.define(f"torchvision::{op}",
                                         "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None


sys.meta_path.insert(0, _DeclareTorchvisionOps())
