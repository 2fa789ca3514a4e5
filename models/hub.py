"""Hugging Face Hub folders for the vlpe backbones: ``config.json``, ``model.safetensors`` and a model card.

:class:`HubMixin` is ``huggingface_hub.PyTorchModelHubMixin`` with three changes: the saved config is the
model *as it is now* (a classifier reset with ``reset_classifier`` is saved with its new head), weights load
strictly (a checkpoint that does not fit raises instead of leaving parameters at their initial values), and
the model card names the encoding, the training data and the measured results::

    model.save_pretrained("vit-fmnist", model_card_kwargs=dict(
        dataset="fashion_mnist", results={"top-1 @ 28 px": 0.871}))
    model = ViT.from_pretrained("vit-fmnist")       # a local folder: no network access

Checked in ``tests/test_hub.py`` against the mixin's own files (``config.json`` as it writes it, the weights
as ``safetensors`` reads them): a round trip gives bitwise-equal outputs, with the network switched off; a
tampered folder (``config.json`` not JSON, not a mapping or of another model; a damaged safetensors header) is a
clear error naming the file (``tests/test_reliability_library.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from huggingface_hub import ModelCard, ModelCardData, PyTorchModelHubMixin
from huggingface_hub.repocard_data import EvalResult

__all__ = ["HubMixin"]

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class HubMixin(
    PyTorchModelHubMixin,
    library_name="vlpe",
    license="apache-2.0",
    tags=["vlpe", "position-encoding"],
):
    """``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` for an ``nn.Module`` whose keyword-only
    constructor arguments describe it.

    A subclass sets ``_card_task`` (the task its results are on) and ``_card_pipeline`` (the Hub pipeline
    tag, None for none) and may override :meth:`_card_architecture` (one line on its shape). Changes made after construction that the saved config must carry are recorded with
    :meth:`_record_config`; a model that no config can rebuild (e.g. pruned blocks) sets ``_unsaveable``
    to a reason.
    """

    _card_task: str = "image-classification"
    _card_pipeline: str | None = "image-classification"
    _unsaveable: str | None = None

    # ------------------------------------------------------------------ config
    def _record_config(self, **changes: Any) -> None:
        """Constructor arguments that differ from the ones the model was built with."""
        self._hub_changes = {**getattr(self, "_hub_changes", {}), **changes}

    def hub_config(self) -> dict[str, Any]:
        """The constructor arguments that rebuild this model as it is now (what ``config.json`` holds)."""
        return {**(self._hub_mixin_config or {}), **getattr(self, "_hub_changes", {})}

    # ------------------------------------------------------------------ save
    def save_pretrained(
        self,
        save_directory: str | Path,
        *,
        config: dict | None = None,
        model_card_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> str | None:
        """Write ``config.json``, ``model.safetensors`` and ``README.md`` (the card, always rewritten: it
        describes these weights) to ``save_directory``. ``model_card_kwargs``: ``dataset`` (what the model was
        trained on) and ``results`` (``{metric name: value}`` measured on it); see the module docstring."""
        if self._unsaveable is not None:
            raise ValueError(f"{type(self).__name__} cannot be saved with save_pretrained: {self._unsaveable}")
        card = dict(model_card_kwargs or {})
        unknown = sorted(set(card) - {"dataset", "results"})
        if unknown:
            raise ValueError(f"model_card_kwargs takes 'dataset' and 'results', got {unknown}")
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        (Path(save_directory) / "README.md").unlink(missing_ok=True)
        return super().save_pretrained(
            save_directory, config=self.hub_config() if config is None else config, model_card_kwargs=card, **kwargs
        )

    def generate_model_card(
        self, *args: Any, dataset: str | None = None, results: Mapping[str, float] | None = None, **kwargs: Any
    ) -> ModelCard:
        """The card: YAML metadata (library, licence, tags, dataset, model-index with the results) and a short
        text naming the encoding, the architecture, the data and each result."""
        if results is not None and (not isinstance(results, Mapping) or not results):
            raise ValueError(f"results must be a non-empty {{metric name: value}} mapping, got {results!r}")
        config = self.hub_config()
        encoding = config.get("encoding", "rope")
        options = config.get("encoding_options") or {}
        name = f"{type(self).__name__} ({encoding})"
        data = ModelCardData(**self._hub_mixin_info.model_card_data.to_dict())
        data.pipeline_tag = self._card_pipeline
        data.tags = sorted({*(data.tags or []), f"encoding:{encoding}"})
        if dataset is not None:
            data.datasets = [dataset]
        if results:
            data.model_name = name
            data.eval_results = [
                EvalResult(
                    task_type=self._card_task,
                    dataset_type=dataset or "unknown",
                    dataset_name=dataset or "unknown",
                    metric_type="accuracy",
                    metric_name=str(metric),
                    metric_value=float(value),
                )
                for metric, value in results.items()
            ]
        lines = [
            f"# {name}",
            "",
            f"A {self._card_architecture()} with the **{encoding}** position encoding"
            + (f" (options: `{options}`)" if options else "")
            + ", from vlpe (position encodings for vision transformers behind one interface).",
            "",
            f"- Training data: {dataset if dataset is not None else 'not recorded'}",
        ]
        if results:
            lines += ["", "| metric | value |", "|---|---|"]
            lines += [f"| {metric} | {float(value):.4f} |" for metric, value in results.items()]
        else:
            lines += ["- Measured results: none recorded"]
        module = type(self).__module__
        lines += [
            "",
            f"Loading needs vlpe's harness, not only the library: `{module}` lives in a checkout of the vlpe repository "
            "(the `vlpe` wheel holds the library alone). In that checkout, after `make setup` (which installs `.venv` "
            "and puts the checkout on its path), run with `.venv/bin/python`:",
            "",
            "```python",
            f"from {module} import {type(self).__name__}",
            f"model = {type(self).__name__}.from_pretrained(\"<this folder or repo id>\")",
            "```",
            "",
        ]
        return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))

    def _card_architecture(self) -> str:
        return type(self).__name__

    # ------------------------------------------------------------------ load
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, **kwargs: Any):
        """The mixin's ``from_pretrained``, with a local folder's ``config.json`` checked first (:meth:`check_config`):
        a file that is not a JSON mapping, or holds another model's arguments, is a ``ValueError`` naming it."""
        folder = Path(pretrained_model_name_or_path)
        if folder.is_dir() and (folder / CONFIG).is_file():
            cls.check_config(folder / CONFIG)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def check_config(cls, path: str | Path) -> dict[str, Any]:
        """The mapping in ``path`` (a ``config.json``), or ``ValueError``: it must be JSON, a mapping, and name only
        constructor arguments of ``cls`` (the mixin would drop other keys silently and build a default model: a
        config of another model family, e.g. a PointTransformer's given to ViT, must not load)."""
        import json

        path = Path(path)
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{path} is not valid JSON ({e}); it must be the config.json save_pretrained wrote: save the model again"
            ) from None
        if not isinstance(config, dict):
            raise ValueError(
                f"{path} must hold a JSON object of {cls.__name__}'s constructor arguments, got a {type(config).__name__}"
            )
        params = getattr(cls, "_hub_mixin_init_parameters", {})
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        unknown = sorted(set(config) - set(params))
        if params and not takes_any and unknown:
            raise ValueError(
                f"{path} is not a {cls.__name__} config: {unknown} are not arguments of {cls.__name__} (it takes "
                f"{sorted(n for n in params if n != 'self')}); load the folder with the class that saved it"
            )
        return config

    @classmethod
    def _from_pretrained(
        cls,
        *,
        model_id: str,
        revision: str | None,
        cache_dir: str | Path | None,
        force_download: bool,
        local_files_only: bool,
        token: str | bool | None,
        map_location: str = "cpu",
        strict: bool = True,
        **model_kwargs: Any,
    ):
        """Build from the config, then load ``model.safetensors`` (strictly by default) from a local folder or
        the Hub (``local_files_only=True``: the cache only); returns the model in eval mode."""
        import safetensors.torch

        if os.path.isdir(model_id):
            weights = Path(model_id) / WEIGHTS
            if not weights.is_file():
                raise ValueError(f"{model_id} has no {WEIGHTS}; expected a folder written by save_pretrained")
        else:
            from huggingface_hub import hf_hub_download

            weights = hf_hub_download(
                repo_id=model_id,
                filename=WEIGHTS,
                revision=revision,
                cache_dir=cache_dir,
                force_download=force_download,
                token=token,
                local_files_only=local_files_only,
            )
        model = cls(**model_kwargs)
        try:
            safetensors.torch.load_model(model, str(weights), strict=strict, device=map_location)
        except (safetensors.SafetensorError, OSError) as e:  # a damaged header or a truncated file
            raise ValueError(
                f"{weights} is not a readable safetensors file ({e}): it is damaged or not the {WEIGHTS} that "
                f"save_pretrained wrote; save the model again"
            ) from None
        except RuntimeError as e:  # names or shapes that do not fit (a header edited, or config overrides)
            raise RuntimeError(f"{weights} does not fit the {cls.__name__} its config describes: {e}") from None
        return model.eval()
