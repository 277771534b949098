from freetoken_jax.cli import main


def test_generate_demo(capsys):
    argv = ["generate", "--model", "demo", "--prompt", "Hi", "--max-new-tokens", "5", "--dtype", "float32", "--max-context", "64",
            "--no-compile-cache"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Hi")
    assert "5 tokens" in out.err or "tokens in" in out.err


def test_generate_reports_errors(capsys):
    assert main(["generate", "--model", "/no/such/dir", "--prompt", "Hi", "--no-compile-cache"]) == 2
    assert "no checkpoint directory" in capsys.readouterr().err
