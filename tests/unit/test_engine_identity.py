"""The model id chunk keys are made from names the weights: new weights saved where the old
ones were, or another revision of a hub id, never share the old weights' KV (a review loaded
retrained weights from the same directory and got answers made with the old model's KV)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from kvctl.engines.hf import model_id_of
from kvctl.engines.identity import model_identity, weights_fingerprint
from kvctl.engines.models import build_model


def _saved(directory: Path, seed: int) -> None:
    build_model("tiny-llama", seed=seed, dtype=torch.float32).save_pretrained(directory)


def test_new_weights_in_the_same_directory_get_a_new_id(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _saved(ckpt, seed=1)
    first = model_id_of(LlamaForCausalLM.from_pretrained(ckpt).config)
    assert first.startswith(f"{ckpt}@weights:")
    _saved(ckpt, seed=2)  # retrained into the same place
    assert model_id_of(LlamaForCausalLM.from_pretrained(ckpt).config) != first


def test_the_same_files_fingerprint_alike_whenever_they_were_copied(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _saved(a, seed=3)
    shutil.copytree(a, b)  # another node's copy: other times, same bytes
    for f in b.iterdir():
        os.utime(f, (1, 1))
    assert weights_fingerprint(a) == weights_fingerprint(b) is not None


def test_a_hub_id_takes_its_revision_and_a_name_alone_stays_as_it_was(tmp_path: Path) -> None:
    assert model_identity("meta-llama/Llama-3.1-8B", revision="0e9e39f") == (
        "meta-llama/Llama-3.1-8B@0e9e39f"
    )
    assert model_identity("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    (tmp_path / "empty").mkdir()
    assert model_identity(str(tmp_path / "empty")) == str(tmp_path / "empty")  # no weights
