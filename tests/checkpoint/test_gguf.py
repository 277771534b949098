"""GGUF files load as they are: config and tokenizer from the metadata, routed experts byte for
byte into the native formats, logits equal to transformers run on the `gguf` package's
dequantization of the same file; split sets, conversion to FTW, and clear refusals."""

import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf_models import Q, reference_model, write_gguf
from hf_models import make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.checkpoint.gguf_file import GGUFCheckpoint
from freetoken_jax.checkpoint.safetensors_io import CheckpointError
from freetoken_jax.config import ConfigError
from freetoken_jax.tokenizer import gguf_tokenizer

BASE = dict(dtype="float32", max_context=48, max_batch=2, page_size=4, prefill_chunk=16)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]
NATIVE = {Q.Q8_0: "q8_0", Q.Q4_0: "q4_0", Q.MXFP4: "mxfp4", Q.Q4_K: "q4_k", Q.Q5_K: "q5_k", Q.Q6_K: "q6_k", Q.F16: "bf16"}
CASES = [
    ("qwen3_moe_norm", Q.Q8_0, Q.F32),
    ("qwen3_moe_norm", Q.MXFP4, Q.F16),
    ("mixtral", Q.Q4_0, Q.Q8_0),  # dense tensors quantized too: dequantized at load
    ("qwen2_moe", Q.Q8_0, Q.F16),
    ("qwen2_moe", Q.F16, Q.F32),  # float experts: the model dtype
    ("qwen3_moe_k", Q.Q4_K, Q.F32),
    ("qwen3_moe_k", Q.Q5_K, Q.Q8_0),
    ("qwen3_moe_k", Q.Q6_K, Q.F32),
    ("deepseek_v3", Q.Q8_0, Q.F32),  # MLA with kv_b split into attn_k_b / attn_v_b, sigmoid routing, YaRN
    ("deepseek_v2_qlora", Q.Q4_0, Q.F16),  # group-limited softmax routing
    ("deepseek_v2", Q.MXFP4, Q.F32),  # kv_b whole, as older converters write it
    ("gpt_oss", Q.MXFP4, Q.F16),  # as released: sliding windows, sinks, biases, YaRN without truncation
]


def ref_logits(hf, path, variant, ids):
    with torch.no_grad():
        return reference_model(hf, path, variant)(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("variant,etype,dtype", CASES, ids=lambda v: getattr(v, "name", v))
def test_gguf_logits_equal_transformers_on_its_dequantized_weights(variant, etype, dtype, ckpt_root, tmp_path):
    hf = make_checkpoint(variant, ckpt_root)
    path = write_gguf(hf, str(tmp_path / "m.gguf"), variant, etype, dtype)
    eng = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, moe_strategy="fused"))
    assert eng.model_config.expert_format == NATIVE[etype] and eng.name == "m"
    if etype != Q.F16:  # the banks are the file's bytes
        r = gguf.GGUFReader(path)
        t = next(t for t in r.tensors if t.name.endswith(".ffn_down_exps.weight"))  # the first MoE layer's
        stored, i = t.data, int(t.name.split(".")[1])
        bank = np.asarray(eng.weights.params["layers"][i]["mlp"]["experts"]["down"].get_value())
        np.testing.assert_array_equal(bank, stored.reshape(stored.shape[0], -1))
    got = np.asarray(eng.logits(PROMPT))
    want = ref_logits(hf, path, variant, PROMPT)
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), rtol=0)


def test_split_set_loads_from_any_part(ckpt_root, tmp_path):
    hf = make_checkpoint("mixtral", ckpt_root)
    one = write_gguf(hf, str(tmp_path / "one.gguf"), "mixtral", Q.Q4_0)
    (tmp_path / "split").mkdir()
    first = write_gguf(hf, str(tmp_path / "split" / "s.gguf"), "mixtral", Q.Q4_0, split_max_tensors=10)
    parts = sorted(os.listdir(tmp_path / "split"))
    assert len(parts) > 2 and first.endswith("-00001-of-" + f"{len(parts):05d}.gguf")
    want = np.asarray(FreeTokenEngine.from_pretrained(one, EngineConfig(**BASE)).logits(PROMPT))
    last = str(tmp_path / "split" / parts[-1])
    eng = FreeTokenEngine.from_pretrained(last, EngineConfig(**BASE))
    np.testing.assert_array_equal(np.asarray(eng.logits(PROMPT)), want)
    assert eng.name == "s"
    os.remove(tmp_path / "split" / parts[1])
    with pytest.raises(CheckpointError, match="missing: " + parts[1]):
        FreeTokenEngine.from_pretrained(first, EngineConfig(**BASE))


def test_convert_gguf_to_ftw_keeps_the_bytes_and_the_tokenizer(ckpt_root, tmp_path):
    from freetoken_jax.checkpoint.convert import convert

    hf = make_checkpoint("qwen3_moe_k", ckpt_root)
    path = write_gguf(hf, str(tmp_path / "k.gguf"), "qwen3_moe_k", Q.Q6_K, tokenizer=tiny_vocab())
    out = convert(path, str(tmp_path / "ftw"), dtype="f32", progress=False)
    a = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE))
    b = FreeTokenEngine.from_pretrained(out, EngineConfig(**BASE))
    assert b.model_config.expert_format == "q6_k"
    np.testing.assert_array_equal(np.asarray(b.logits(PROMPT)), np.asarray(a.logits(PROMPT)))
    text = "hello world"
    assert b.tokenizer.encode(text) == a.tokenizer.encode(text) and b.tokenizer.chat_template == a.tokenizer.chat_template
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == CHAT_TEMPLATE


# Tokenizer ----------------------------------------------------------------------------------------
QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# DeepSeek-V3's tokenizer.json: three splits before the byte-level step
DEEPSEEK_V3_REGEXES = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                       r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
# gpt-oss's tokenizer.json (o200k)
GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?"
               r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
PRE = {"qwen2": (QWEN2_REGEX,), "deepseek-v3": DEEPSEEK_V3_REGEXES, "gpt-4o": (GPT4O_REGEX,)}
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello there! 12345 numbers 2026.", "naïve café déjà vu — ünïcode",
          "def f(x):\n    return x * 2\n\n", "It's what we'll do; they've seen I'd go."] * 20  # fmt: skip


def train_bpe(vocab_size, pre="qwen2"):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIALS)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def tiny_vocab(vocab_size=330, pre="qwen2"):
    """A GGUFWriter callback writing a trained byte-level BPE as llama.cpp's converter does."""
    tok = train_bpe(vocab_size, pre)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]

    def write(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        w.add_eos_token_id(vocab["<|im_end|>"])
        w.add_bos_token_id(vocab["<|endoftext|>"])
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)

    write.tok = tok
    return write


@pytest.mark.parametrize("pre", sorted(PRE))
def test_gguf_tokenizer_encodes_and_decodes_as_the_original(pre, ckpt_root, tmp_path):
    vocab = tiny_vocab(pre=pre)
    hf = make_checkpoint("qwen3_moe_norm", ckpt_root)
    path = write_gguf(hf, str(tmp_path / "t.gguf"), "qwen3_moe_norm", Q.Q8_0, tokenizer=vocab)
    mine = gguf_tokenizer(GGUFCheckpoint(path))
    texts = CORPUS[:5] + ["<|im_start|>user\nUnseen wörds: 987654, ALL CAPS!!\n\n  spaces<|im_end|>\n", "日本語のテキスト 🙂", ""]
    for text in texts:
        want = vocab.tok.encode(text).ids
        assert mine.encode(text, add_bos=False) == want, text
        assert mine.decode(want) == vocab.tok.decode(want, skip_special_tokens=True)
    assert mine.chat_template == CHAT_TEMPLATE and mine.bos_token_id == vocab.tok.token_to_id("<|endoftext|>")
    assert mine.prompt_start() == [] and mine.encode("hi") == mine.encode("hi", add_bos=False)  # add_bos_token false
    # the server renders with the file's template; the engine takes text prompts
    eng = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE))
    assert eng.tokenizer.chat_template == CHAT_TEMPLATE


# Refusals -----------------------------------------------------------------------------------------
def test_bad_files_are_refused_naming_the_tensor(ckpt_root, tmp_path):
    hf = make_checkpoint("qwen3_moe_norm", ckpt_root)
    good = write_gguf(hf, str(tmp_path / "g.gguf"), "qwen3_moe_norm", Q.Q8_0)
    data = open(good, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"tensor \S+ needs bytes .* truncated"):
        FreeTokenEngine.from_pretrained(str(cut), EngineConfig(**BASE))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGML" + data[4:200])
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        FreeTokenEngine.from_pretrained(str(junk), EngineConfig(**BASE))
    with pytest.raises(CheckpointError, match="no GGUF file"):
        FreeTokenEngine.from_pretrained(str(tmp_path / "absent.gguf"), EngineConfig(**BASE))


def q4_k_m(layer, g):
    """Q4_K_M's expert types: gate/up Q4_K; down Q6_K in some layers (here the first), Q4_K in the rest."""
    return Q.Q6_K if g == "ffn_down_exps" and layer == 0 else Q.Q4_K


def test_a_q4_k_m_file_keeps_each_layers_types(ckpt_root, tmp_path, monkeypatch):
    """Down projections in Q6_K in one layer and Q4_K in the other: every bank as stored, slots as
    wide as the widest layer's rows, and every strategy gives the file's float reference tokens."""
    hf = make_checkpoint("qwen3_moe_k", ckpt_root)
    path = write_gguf(hf, str(tmp_path / "km.gguf"), "qwen3_moe_k", q4_k_m)
    fused = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, moe_strategy="fused"))
    cfg = fused.model_config
    assert cfg.expert_format == "q4_k" and cfg.expert_formats == (("q4_k", "q4_k", "q6_k"), ("q4_k", "q4_k", "q4_k"))
    r = gguf.GGUFReader(path)
    for i in range(2):
        stored = next(t for t in r.tensors if t.name == f"blk.{i}.ffn_down_exps.weight").data
        bank = np.asarray(fused.weights.params["layers"][i]["mlp"]["experts"]["down"].get_value())
        np.testing.assert_array_equal(bank, stored.reshape(stored.shape[0], -1))
    want = ref_logits(hf, path, "qwen3_moe_k", PROMPT)
    np.testing.assert_allclose(np.asarray(fused.logits(PROMPT)), want, atol=2e-4 * np.abs(want).max(), rtol=0)
    monkeypatch.setenv("FREETOKEN_CPU_TIER", "avx512f")
    prompts = [PROMPT, [27, 18, 28]]
    tokens = fused.generate_batch(prompts, max_new_tokens=6, ignore_eos=True)
    one = dict(BASE, max_batch=1)
    for strategy, kw in (("offload", dict(expert_slots=2)), ("hybrid", dict(expert_slots=2, hybrid_q=0.5)), ("cpu", {})):
        eng = FreeTokenEngine.from_pretrained(path, EngineConfig(**one, moe_strategy=strategy, **kw))
        assert eng.generate_batch(prompts, max_new_tokens=6, ignore_eos=True) == tokens, strategy
        np.testing.assert_allclose(np.asarray(eng.logits(PROMPT)), np.asarray(fused.logits(PROMPT)), atol=1e-4, rtol=0)


def test_types_without_kernels_and_mixed_types_need_an_explicit_requantize(ckpt_root, tmp_path):
    hf = make_checkpoint("qwen3_moe_k", ckpt_root)
    q5_0 = write_gguf(hf, str(tmp_path / "q5_0.gguf"), "qwen3_moe_k", Q.Q5_0)
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_down_exps\.weight has type Q5_0.*expert_format"):
        FreeTokenEngine.from_pretrained(q5_0, EngineConfig(**BASE))
    mixed = write_gguf(
        hf, str(tmp_path / "m.gguf"), "qwen3_moe_k", {"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q6_K, "ffn_down_exps": Q.Q4_K}
    )
    with pytest.raises(CheckpointError, match=r"mix types \(blk\.0\.ffn_gate_exps\.weight is Q4_K, blk\.0\.ffn_up_exps\.weight is Q6_K\)"):
        FreeTokenEngine.from_pretrained(mixed, EngineConfig(**BASE))
    # asked for: re-quantized on load, and close to the file's own weights
    eng = FreeTokenEngine.from_pretrained(mixed, EngineConfig(**BASE, expert_format="q8_0"))
    assert eng.model_config.expert_format == "q8_0"
    want = ref_logits(hf, mixed, "qwen3_moe_k", PROMPT)
    got = np.asarray(eng.logits(PROMPT))
    assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()  # q8_0 of 4-6 bit weights (6% measured: one routing flip)


def rewrite(src: str, out: str, keys: dict) -> None:
    """A copy of the GGUF file `src` with metadata `keys` set (uint32 where new)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in keys:
            continue
        w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for k, v in keys.items():
        w.add_key_value(k, v, gguf.GGUFValueType.UINT32)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=None, raw_dtype=t.tensor_type if t.tensor_type not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_shape_and_architecture_mismatches_are_refused_before_loading(ckpt_root, tmp_path):
    hf = make_checkpoint("qwen3_moe_norm", ckpt_root)
    path = write_gguf(hf, str(tmp_path / "a.gguf"), "qwen3_moe_norm", Q.Q8_0)
    # a copy whose metadata claims another expert width: the expert tensors no longer fit
    rewrite(path, str(tmp_path / "b.gguf"), {"qwen3moe.expert_feed_forward_length": 64})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_\w+_exps\.weight has shape \(8, \d+, \d+\), the config needs"):
        FreeTokenEngine.from_pretrained(str(tmp_path / "b.gguf"), EngineConfig(**BASE))
    # a window on an architecture that does not say where it applies (llama.cpp ignores it there)
    rewrite(path, str(tmp_path / "w.gguf"), {"qwen3moe.attention.sliding_window": 8})
    with pytest.raises(ConfigError, match="sliding_window is set, and qwen3moe does not say which layers"):
        FreeTokenEngine.from_pretrained(str(tmp_path / "w.gguf"), EngineConfig(**BASE))
    other = gguf.GGUFWriter(str(tmp_path / "c.gguf"), "rwkv6")
    other.add_block_count(1)
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.write_tensors_to_file()
    other.close()
    with pytest.raises(ConfigError, match="architecture 'rwkv6' is not supported"):
        FreeTokenEngine.from_pretrained(str(tmp_path / "c.gguf"), EngineConfig(**BASE))


def test_sentencepiece_vocabulary_encodes_and_decodes_as_sentencepiece(ckpt_root, tmp_path):
    """A Mixtral-style GGUF vocabulary (`llama`: SentencePiece BPE with byte fallback), written
    as llama.cpp's converter writes it, against sentencepiece itself."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
    )  # fmt: skip (as Llama and Mistral models are trained)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))

    def vocab(w):
        n = sp.get_piece_size()
        kinds = [
            2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i) else 1 for i in range(n)
        ]
        w.add_tokenizer_model("llama")
        w.add_token_list([sp.id_to_piece(i) for i in range(n)])
        w.add_token_scores([sp.get_score(i) for i in range(n)])
        w.add_token_types(kinds)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)

    hf = make_checkpoint("mixtral", ckpt_root)
    path = write_gguf(hf, str(tmp_path / "sp.gguf"), "mixtral", Q.Q4_0, tokenizer=vocab)
    mine = gguf_tokenizer(GGUFCheckpoint(path))
    for text in CORPUS[:5] + ["Unseen wörds: 987654, ALL CAPS!!", "  two leading spaces and   runs", "日本語 🙂 (bytes)", "x"]:
        want = sp.encode(text)
        assert mine.encode(text, add_bos=False) == want, (text, want)
        assert mine.decode(want) == sp.decode(want), text
    assert mine.prompt_start() == [1] and mine.encode("hi") == [1, *mine.encode("hi", add_bos=False)]  # add_bos_token
