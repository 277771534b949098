"""Conversion to FTW, FTW loading, and Orbax export/import of the engine's parameter tree.

`convert(src, dst)` reads a Hugging Face safetensors directory of a supported family, or an
Orbax checkpoint written by `export_orbax`, and writes an FTW directory tensor by tensor (one
layer's expert stack at a time in memory), copies the non-weight files (config, tokenizer,
generation config), records a fingerprint of the source, and verifies every checksum by reading
the result back. Any failure removes the partial output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np

from freetoken_jax.checkpoint.ftw import FTWReader, FTWWriter, aligned_empty
from freetoken_jax.checkpoint.hf import HFSource
from freetoken_jax.checkpoint.safetensors_io import CheckpointError
from freetoken_jax.config import DTYPE_NAMES, EXPERT_FORMATS, ConfigError, MoEModelConfig
from freetoken_jax.models import build_abstract, is_expert_path
from freetoken_jax.models.generic import config_from_json, config_to_json
from freetoken_jax.progress import progress as progress_bar

ORBAX_MARKER = "freetoken_orbax.json"
DTYPES = DTYPE_NAMES


def _name(path: tuple) -> str:
    return "/".join(map(str, path))


def fingerprint(src: str) -> str:
    """sha256 over every file's name and size and the first MiB of each weight file."""
    h = hashlib.sha256()
    if os.path.isfile(src):
        h.update(os.path.basename(src).encode() + str(os.path.getsize(src)).encode())
        with open(src, "rb") as fh:
            h.update(fh.read(1 << 20))
        return h.hexdigest()
    for root, _, files in sorted(os.walk(src)):
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(os.path.relpath(p, src).encode())
            h.update(str(os.path.getsize(p)).encode())
            if f.endswith((".safetensors", ".ftw")) or "ocdbt" in p or f.startswith("d"):
                with open(p, "rb") as fh:
                    h.update(fh.read(1 << 20))
    return h.hexdigest()


def _source(src: str, expert_format: str | None = None):
    """(config, tensor getter by parameter path, kind, tokenizer to write or None) of a conversion
    source."""
    if src.endswith(".gguf"):
        from freetoken_jax.checkpoint.gguf_file import GGUFCheckpoint, GGUFParams, read_config
        from freetoken_jax.tokenizer import gguf_tokenizer

        ck = GGUFCheckpoint(src)
        _, cfg, requantize = read_config(ck, expert_format)
        params = GGUFParams(ck, cfg, requantize)
        params.check(list(build_abstract(cfg, "float32").flat_state()))
        return cfg, params.get, "gguf", gguf_tokenizer(ck)
    if os.path.isfile(os.path.join(src, ORBAX_MARKER)):
        import orbax.checkpoint as ocp

        with open(os.path.join(src, ORBAX_MARKER)) as f:
            cfg = config_from_json(json.load(f))
        tree = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(src, "params")))

        def get(path):
            node = tree
            for p in path:
                node = node[str(p)]
            return np.asarray(node)

        return cfg, get, "orbax", None
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise ConfigError(f"{src}: no config.json (and no {ORBAX_MARKER}); not a convertible checkpoint")
    hf = HFSource(src, expert_format)
    hf.check(list(build_abstract(hf.cfg, "float32").flat_state()))
    return hf.cfg, hf.get, "safetensors", None


def convert(src: str, dst: str, *, dtype: str | None = "bf16", shard_gib: float = 8.0, verify: bool = True, progress: bool = True,
            expert_format: str | None = None) -> str:  # fmt: skip
    """Writes the FTW directory `dst` from `src`; returns its path. `expert_format`: quantize the
    routed experts to this format (`docs/FORMATS.md`) as they are written, a layer at a time; the
    index's model config records it, so loading needs no flag."""
    if not os.path.isdir(src) and not (src.endswith(".gguf") and os.path.isfile(src)):
        raise FileNotFoundError(f"no checkpoint directory or .gguf file at {src!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    cfg, get, kind, tokenizer = _source(src, expert_format)
    target = cfg.with_expert_format(expert_format)  # ConfigError before anything is written
    quantize = target.expert_format != cfg.expert_format
    want = DTYPES[dtype] if dtype else None
    abstract = list(build_abstract(cfg, want or "float32").flat_state())
    total = sum(int(np.prod(v.get_value().shape)) * v.get_value().dtype.itemsize for _, v in abstract)
    meta = dict(
        model_config=config_to_json(target),
        dtype=want or "source",
        source=dict(path=os.path.abspath(src), kind=kind, fingerprint=fingerprint(src)),
    )
    shard_bytes = max(2 * 4096, int(shard_gib * (1 << 30)) // 4096 * 4096)
    bar = progress_bar(total, "convert") if progress else None
    try:
        with FTWWriter(dst, shard_bytes=shard_bytes, metadata=meta) as w:
            for path, var in abstract:
                a = np.asarray(get(path))
                sds = var.get_value()
                if tuple(a.shape) != tuple(sds.shape):
                    raise CheckpointError(f"{src}: {_name(path)} has shape {tuple(a.shape)}, the config needs {tuple(sds.shape)}")
                if want is not None and a.dtype != sds.dtype:
                    a = np.asarray(np.asarray(a, np.float32), dtype=sds.dtype)
                if quantize and is_expert_path(path):
                    from freetoken_jax.quant.banks import quantize_stack

                    a = np.asarray(quantize_stack(target.expert_format, a))
                w.add(_name(path), a, "experts_bank" if is_expert_path(path) else "weight")
                if bar is not None:
                    bar.update(int(np.prod(sds.shape)) * sds.dtype.itemsize)
            if tokenizer is not None:
                tokenizer.save(w.tmp)
            for f in sorted(os.listdir(src)) if os.path.isdir(src) else ():  # config, tokenizer, generation config, templates
                fp = os.path.join(src, f)
                if os.path.isfile(fp) and not f.endswith((".safetensors", ".safetensors.index.json", ".bin", ".pt")) and f != ORBAX_MARKER:
                    shutil.copy2(fp, os.path.join(w.tmp, f))
    except OSError as e:  # disk full, permissions: the partial output is already removed
        raise CheckpointError(f"conversion to {dst} failed and left nothing behind: {e}") from e
    finally:
        if bar is not None:
            bar.close()
    if verify:
        with FTWReader(dst) as r:
            r.verify_all()
    return dst


def load_ftw(path: str, dtype: str, place=None, *, verify: bool = False, progress: bool = True):
    """(config, parameter state) of an FTW directory. Shapes are checked against the config from
    the index before anything is read; each tensor is read into one reused aligned buffer and
    placed (`place(path, array)`, default: the device) before the next is read."""
    import jax.numpy as jnp
    from flax import nnx

    with FTWReader(path, verify=verify) as r:
        mc = r.index.get("model_config")
        if not mc:
            raise CheckpointError(f"{path}: the FTW index has no model_config")
        cfg = config_from_json(mc)
        abstract = list(build_abstract(cfg, dtype).flat_state())
        for p, var in abstract:
            n = _name(p)
            if n not in r:
                raise CheckpointError(f"{path}: tensor {n!r} is missing from the checkpoint")
            if tuple(r.tensors[n]["shape"]) != tuple(var.get_value().shape):
                raise CheckpointError(
                    f"{path}: {n} has shape {tuple(r.tensors[n]['shape'])}, the config needs {tuple(var.get_value().shape)}"
                )
        buf = aligned_empty(max(r.tensors[_name(p)]["nbytes"] for p, _ in abstract))
        bar = progress_bar(r.nbytes(), "loading weights") if progress else None
        flat = []
        for p, var in abstract:
            a = r.get(_name(p), out=buf)
            dt = var.get_value().dtype
            a = np.asarray(np.asarray(a, np.float32), dtype=dt) if a.dtype != dt else a
            # `a` may view the reused buffer: the placed array must own its memory.
            flat.append((p, var.replace(place(p, np.array(a, copy=True) if a.base is not None else a) if place else jnp.array(a))))
            if bar is not None:
                bar.update(r.tensors[_name(p)]["nbytes"])
        if bar is not None:
            bar.close()
    return cfg, nnx.State.from_flat_path(flat)


def export_orbax(cfg: MoEModelConfig, params, path: str) -> str:
    """Writes the parameter tree (engine layout, experts as [E, ...] stacks) as an Orbax
    checkpoint under `path/params`, with the model config beside it."""
    import orbax.checkpoint as ocp

    abstract = dict(build_abstract(cfg, "float32").flat_state())
    tree: dict = {}
    for p, var in params.flat_state():
        a = np.asarray(var.get_value())
        node = tree
        for k in p[:-1]:
            node = node.setdefault(str(k), {})
        node[str(p[-1])] = a.reshape(abstract[p].get_value().shape)
    os.makedirs(path, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.abspath(os.path.join(path, "params")), tree)
    ckpt.wait_until_finished()
    with open(os.path.join(path, ORBAX_MARKER), "w") as f:
        json.dump(config_to_json(cfg), f, indent=1)
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    from freetoken_jax.cli import HelpFormatter

    ap = argparse.ArgumentParser(
        prog="freetoken-jax convert",
        formatter_class=HelpFormatter,
        description="Convert a Hugging Face safetensors directory, a GGUF file or an Orbax checkpoint to FTW.",
    )
    ap.add_argument("src", help="a Hugging Face directory, a .gguf file or an Orbax checkpoint")
    ap.add_argument("dst", help="the FTW directory to write")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dense weights' dtype")
    ap.add_argument("--shard-gib", type=float, default=8.0, help="largest shard file")
    ap.add_argument("--no-verify", action="store_true", help="skip reading the result back to verify checksums")
    ap.add_argument("--expert-format", default=None, choices=list(EXPERT_FORMATS),
                    help="quantize the routed experts to this format as they are written (docs/FORMATS.md); default: as the source")  # fmt: skip
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error (default: one line)")
    args = ap.parse_args(argv)

    def run() -> int:
        print(convert(args.src, args.dst, dtype=args.dtype, shard_gib=args.shard_gib, verify=not args.no_verify,
                      expert_format=args.expert_format))  # fmt: skip
        return 0

    from freetoken_jax.cli import one_line_errors

    return one_line_errors(run, args.debug)
