"""The command line keeps compiled steps on disk: a second run with the same model and settings
loads them (JAX's persistent compilation cache reports hits) and generates the same text."""

import os
import subprocess
import sys

RUN = (
    "import sys\n"
    "from jax import monitoring\n"
    "hits = []\n"
    "monitoring.register_event_listener(lambda e, **k: hits.append(e) if e.endswith('/cache_hits') else None)\n"
    "from freetoken_jax.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('\\nHITS', len(hits))\n"
    "sys.exit(rc)\n"
)


def run(*args):
    argv = ["generate", "--model", "demo", "--prompt", "Once", "--max-new-tokens", "6", "--dtype", "float32", "--max-context", "64",
            "--strategy", "offload", *args]  # fmt: skip
    p = subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    text, hits = p.stdout.rsplit("\nHITS ", 1)
    return text, int(hits), p.stderr


def test_second_run_loads_compiled_steps(tmp_path):
    cache = tmp_path / "xla"
    text1, hits1, err1 = run("--compile-cache", str(cache))
    assert f"compiled steps cached in {cache}" in err1
    assert hits1 == 0 and len(os.listdir(cache)) > 0  # the steps that took over a second to compile are kept
    text2, hits2, _ = run("--compile-cache", str(cache))
    assert hits2 > 0 and text2 == text1
    text3, hits3, err3 = run("--no-compile-cache")
    assert hits3 == 0 and "compiled steps cached" not in err3 and text3 == text1
