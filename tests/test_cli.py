from freetoken_jax.cli import main


def test_generate_demo(capsys):
    argv = ["generate", "--model", "demo", "--prompt", "Hi", "--max-new-tokens", "5", "--dtype", "f32", "--max-context", "64",
            "--no-compile-cache"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Hi")
    assert "[5 tokens; first text after" in out.err  # convert's dtype names are taken too


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


def test_generate_prints_whole_characters_and_no_control_bytes(capsys):
    from freetoken_jax import EngineConfig, FreeTokenEngine
    from freetoken_jax.cli import printable

    assert printable("a\x1b[2Jb\n\tc\x0f") == "a\ufffd[2Jb\n\tc\ufffd"
    argv = ["generate", "--model", "demo", "--prompt", "héllo 🙂", "--max-new-tokens", "12", "--dtype", "float32", "--max-context", "64",
            "--no-compile-cache"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    engine = FreeTokenEngine.from_pretrained("demo", EngineConfig(dtype="float32", max_context=64, max_batch=1))
    want = engine.tokenizer.decode(list(engine.generate("héllo 🙂", max_new_tokens=12)))
    assert out == printable("héllo 🙂" + want) + "\n"  # the text decoded whole, not token by token; the newline on stdout


def test_chat_keeps_the_conversation(capsys, monkeypatch):
    import io

    from freetoken_jax import EngineConfig, FreeTokenEngine
    from freetoken_jax.cli import printable
    from freetoken_jax.server.text import chat_template, render_chat

    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\nand again\n/reset\nhello there\n/exit\nnot read\n"))
    argv = ["chat", "--model", "demo", "--max-new-tokens", "6", "--dtype", "float32", "--max-context", "256", "--no-compile-cache"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    engine = FreeTokenEngine.from_pretrained("demo", EngineConfig(dtype="float32", max_context=256, max_batch=1))
    tok = engine.tokenizer
    template = getattr(tok, "chat_template", None) or chat_template(engine.model_path)
    prompt = render_chat(template, [{"role": "user", "content": "hello there"}])
    first = printable(tok.decode(list(engine.generate(tok.encode(prompt), max_new_tokens=6)))) + "\n"
    # the first turn's reply, then the second's (after both turns), then the first's again after /reset
    assert out.startswith(first) and out.endswith(first) and len(out) > 2 * len(first)


def test_bench_and_convert_are_subcommands(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0 and "bw" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["convert", "--help"])
    assert e.value.code == 0 and "--expert-format" in capsys.readouterr().out
