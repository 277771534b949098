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


def test_generate_refuses_a_request_before_compiling_or_printing(capsys):
    """A request the engine would refuse (too long for the context, a bad sampling value) is said
    before any step compiles and before the prompt is echoed."""
    for extra, said in ((["--max-context", "8"], "exceeds the configured context of 8 tokens"), (["--top-p", "0"], "0 < top_p <= 1")):
        argv = ["generate", "--model", "demo", "--prompt", "The for statement", "-n", "8", "--dtype", "float32", "--no-compile-cache",
                *extra]  # fmt: skip
        assert main(argv) == 2
        out = capsys.readouterr()
        assert out.out == "" and said in out.err and "compiling" not in out.err


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
    argv = ["generate", "--model", "demo", "--prompt", "héllo 🙂", "--max-tokens", "12", "--dtype", "float32", "--max-context", "64",
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
    argv = ["chat", "--model", "demo", "-n", "6", "--dtype", "float32", "--max-context", "256", "--no-compile-cache"]
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


def test_help_shows_defaults_and_shared_flags(capsys):
    import pytest

    for cmd, want in (("generate", ["--slots-gb", "--vram-gb", "--debug", "(default: 48)"]), ("serve", ["--slots-gb", "(default: 8000)"]),
                      ("chat", ["(default: 256)"]), ("ctl", ["(default: http://127.0.0.1:8000)"])):  # fmt: skip
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        assert all(w in out for w in want), (cmd, [w for w in want if w not in out])
    with pytest.raises(SystemExit):
        main(["bench", "decode", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--slots-gb" in out and "(default: [16.0])" in out and "--vram-gb" not in out


def test_vram_gb_has_one_meaning(capsys):
    """`bench` takes the slot budget as --slots-gb; --vram-gb (the whole device budget of
    generate/serve) is refused there with the reason, not read as something else."""
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["bench", "decode", "--preset", "demo", "--vram-gb", "1"])
    assert e.value.code == 2 and "--slots-gb" in capsys.readouterr().err


def test_errors_are_one_line_unless_debug(capsys):
    import pytest

    from freetoken_jax.checkpoint.safetensors_io import CheckpointError

    for argv in (["bench", "decode", "--model", "/no/such/dir"], ["convert", "/no/such/dir", "/tmp/x"],
                 ["generate", "--model", "/no/such/dir", "--prompt", "Hi", "--no-compile-cache"]):  # fmt: skip
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err, argv
    with pytest.raises(CheckpointError):
        main(["generate", "--model", "/no/such/dir", "--prompt", "Hi", "--no-compile-cache", "--debug"])
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        main(["bench", "--debug", "decode", "--model", "/no/such/dir"])


def test_generate_compiles_first_and_times_decode_apart(capsys):
    """`generate` compiles every step the prompt runs before generating (saying so), so that the
    generation compiles nothing and its decode rate is the decode's."""
    from freetoken_jax import EngineConfig, FreeTokenEngine

    engine = FreeTokenEngine.from_pretrained("demo", EngineConfig(dtype="float32", max_context=160, max_batch=1, prefill_chunk=32))
    prompt = list(range(65, 65 + 70))  # 70 tokens: chunks of 32, 32 and a 16-token bucket
    engine.runner.steps.precompile(engine.runner.prompt_jobs(len(prompt)))
    before = dict(engine.runner.steps.traces)
    assert len(list(engine.generate(prompt, max_new_tokens=4, ignore_eos=True))) == 4
    assert engine.runner.steps.traces == before
    assert main(["generate", "--model", "demo", "--prompt", "Hi", "--max-new-tokens", "3", "--no-compile-cache"]) == 0
    assert "compiling the prefill and decode steps" in capsys.readouterr().err


def test_a_missing_tokenizer_is_said_before_any_weight_is_read(ckpt_root, capsys, monkeypatch):
    import os

    from hf_models import make_checkpoint

    path = make_checkpoint("mixtral", ckpt_root)
    assert not os.path.exists(os.path.join(path, "tokenizer.json"))

    def no_load(*a, **k):
        raise AssertionError("weights were read before the tokenizer was checked")

    monkeypatch.setattr("freetoken_jax.checkpoint.hf.load_params", no_load)
    assert main(["generate", "--model", path, "--prompt", "Hi", "--no-compile-cache"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    # a GGUF file without a vocabulary (tokenizer.ggml.model = no_vocab) alike
    from gguf import GGMLQuantizationType as Q
    from gguf_models import write_gguf

    gguf_path = write_gguf(path, os.path.join(ckpt_root, "no_vocab.gguf"), "mixtral", Q.F32)
    assert main(["generate", "--model", gguf_path, "--prompt", "Hi", "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and "Traceback" not in err


def test_chat_gives_the_template_its_variables(capsys, monkeypatch):
    import io

    from freetoken_jax.server import text

    seen, real = [], text.render_chat
    monkeypatch.setattr(text, "render_chat", lambda t, m, **kw: seen.append(kw) or real(t, m, **kw))
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n/exit\n"))
    argv = ["chat", "--model", "demo", "--max-new-tokens", "2", "--dtype", "float32", "--max-context", "128", "--no-compile-cache"]
    assert main(argv + ["--template-kwargs", '{"enable_thinking": false}', "--reasoning-effort", "high"]) == 0
    assert seen == [{"enable_thinking": False, "reasoning_effort": "high"}]
    capsys.readouterr()
    for bad, says in (("[1]", "a JSON object"), ("{bad", "not valid JSON"), ('{"messages": []}', "cannot set messages")):
        assert main(argv + ["--template-kwargs", bad]) == 2 and says in capsys.readouterr().err
