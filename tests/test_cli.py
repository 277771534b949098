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


def test_serve_says_a_taken_port_before_loading(capsys, monkeypatch):
    import socket

    from freetoken_jax import FreeTokenEngine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the port was bound")

    monkeypatch.setattr(FreeTokenEngine, "from_pretrained", no_load)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "demo", "--port", str(port), "--grpc-port", "-1", "--no-compile-cache"]) == 2
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
