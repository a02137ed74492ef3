"""Check our GGUF exports with llama.cpp itself (llama-cpp-python), outside the test suite.

    pip install llama-cpp-python        # builds llama.cpp from source (minutes to half an hour on 2 cores)
    python scripts/check_llama_cpp.py [--presets llama-tiny,qwen2-tiny] [--out DIR]

For each tiny preset (GPT-2, LLaMA, Llama 3.1 RoPE scaling, Qwen2, Qwen3, Mistral) a random model over a
400-piece SentencePiece tokenizer is exported as Q8_0 GGUF (block 64), and llama.cpp:

- loads the file and tokenizes text as our tokenizer does;
- run on the same file with its tensors dequantized to F32 by gguf-py (F32 KV cache), gives the logits
  of our model with the dequantized weights (max |diff| relative to max |logit|) and the same greedy
  continuation: the file holds exactly our weights and llama.cpp computes our model with them (GPT-2:
  ggml's GELU goes through an fp16 table, 4e-4 relative; our model with that rounding is compared too);
- run on the Q8_0 file itself: the relative logit difference (llama.cpp's quantized matmuls also quantize
  the activations to 8 bits, so it is about 1%, not 1e-6) and how many greedy tokens agree.

Then, for the published byte-level BPE layouts (`published_tokenizer`: Qwen2 / Qwen3 and Llama 3, rebuilt from
their tokenizer.json structure on a small vocabulary), a model exported with each: llama.cpp reads the
pre-tokenizer its GGUF names ('qwen2', 'llama-bpe'), tokenizes texts (contractions, digit runs, whitespace and
newline runs, accents, CJK) as the tokenizers library does, tokenizes a chat rendered with the GGUF's own
`tokenizer.chat_template` as transformers' `apply_chat_template` does, and adds BOS as the tokenizer says.

Exits non-zero when a load, the tokenization, the F32 logits (> 1e-4 relative; GPT-2 with fp16 GELU), the
F32 greedy tokens or a published layout's tokenization fail.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from data.corpus import default_corpus
from data.tokenizer import load_tokenizer, train_sentencepiece
from export import dequantized_state_dict, export_gguf
from models.config import ModelConfig
from models.generate import generate
from models.transformer import Transformer

PRESETS = ("gpt2-tiny", "llama-tiny", "llama3-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-tiny")
TOKENS, VOCAB, BITS, BLOCK = 400, 416, 8, 64
PROMPT_LEN, NEW_TOKENS = 12, 16  # within mistral-tiny's 32-token window, which its GGUF declares as the context
TEXT = "Return the number of items in a container, and raise an error when it is empty."

# The published byte-level BPE layouts, as their tokenizer.json and tokenizer_config.json have them (Qwen2 /
# Qwen2.5 / Qwen3 share one; Llama 3.x another). Only the vocabulary is ours: trained here on a few texts.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
LAYOUT_TEXTS = [
    "Hello world! It's a test: we'll see if they've split the words, didn't they? I'm sure you'd like it.",
    "Numbers 1, 22, 333, 4444 and 1234567 split into digits (Qwen2) or runs of three (Llama 3).",
    "def f(x):\n    return x  # indented\n\n\n   trailing spaces   \n\tand tabs",
    "Accents: héllo wörld, naïve café; CJK: 你好，世界; emoji: 🙂 ½",
    "ALL CAPS IT'S WE'LL, mixed CaSe and punctuation!!! ... --- ???",
]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to 12345 people."},
        {"role": "assistant", "content": "Hello, 12345 people!"}, {"role": "user", "content": "It's done?"}]


def published_tokenizer(directory: Path, layout: str, texts=LAYOUT_TEXTS, vocab_size: int = 360,
                        template_file: bool = False) -> Path:
    """A tokenizer directory in the published `layout` ("qwen2": Qwen2 / Qwen3, "llama3": Llama 3): the
    tokenizer.json structure (normalizer, Split regex + ByteLevel(use_regex=False) pre-tokenizer, decoder,
    post-processor, ignore_merges), a byte-level BPE of `vocab_size` trained on `texts` with the special tokens
    after it, and tokenizer_config.json (special tokens, class, chat template; in chat_template.jinja instead
    with `template_file`, as transformers 5 saves it). Built with the tokenizers library; nothing downloaded."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    qwen = layout == "qwen2"
    tok = Tokenizer(models.BPE(ignore_merges=not qwen))
    if qwen:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT if qwen else LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=not qwen, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=not qwen, trim_offsets=not qwen, use_regex=not qwen)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    specials = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"] if qwen else
                ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if qwen:
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        config = {"add_bos_token": False, "add_prefix_space": False, "bos_token": None, "chat_template": CHATML,
                  "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
                  "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
                  "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    else:
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                          special_tokens=[(bos, tok.token_to_id(bos))])])
        config = {"bos_token": bos, "chat_template": LLAMA3_CHAT, "clean_up_tokenization_spaces": True,
                  "eos_token": "<|eot_id|>", "model_input_names": ["input_ids", "attention_mask"],
                  "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if template_file:
        (directory / "chat_template.jinja").write_text(config.pop("chat_template"), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return directory


def random_model(preset: str) -> Transformer:
    """Matrices at std 0.2 (HF's 0.02 makes greedy decoding repeat one token), vectors moved off 0 / 1 so
    that a bias or norm gain put in the wrong place shows."""
    torch.manual_seed(0)
    extra = {"d_ff": 128} if preset == "llama-tiny" else {}  # its 176 is no multiple of GGUF's 32-element blocks
    model = Transformer(ModelConfig.from_preset(preset, vocab_size=VOCAB, **extra))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def f32_copy(src: Path, dst: Path) -> Path:
    """The same GGUF file with every tensor dequantized to F32 by gguf-py (metadata copied as it is)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        if name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape(tuple(reversed([int(n) for n in t.shape]))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def llama_cpp_run(path: Path, prompt: list[int], f32_cache: bool) -> tuple[np.ndarray, list[int], list[int]]:
    """llama.cpp's logits at every prompt position, its greedy continuation (argmax, no sampler state) and
    its tokenization of TEXT."""
    from llama_cpp import Llama

    kw = dict(type_k=0, type_v=0) if f32_cache else {}  # GGML_TYPE_F32
    llm = Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False, n_threads=1, seed=0,
                **kw)
    try:
        llm.eval(prompt)
        logits = np.array(llm.scores[:len(prompt)], dtype=np.float32)
        new = []
        for _ in range(NEW_TOKENS):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            new.append(token)
            llm.eval([token])
        return logits, new, llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    finally:
        llm.close()


def ggml_gelu(model: Transformer) -> Transformer:
    """ggml computes GELU through an fp16 table (GGML_GELU_FP16): its input and its output are fp16 values.
    Rounds them so in `model` (hooks around the activation), to tell that rounding from a wrong weight."""
    for block in model.blocks:
        block.mlp.up_proj.register_forward_hook(lambda module, args, out: out.half().float())
        block.mlp.down_proj.register_forward_pre_hook(lambda module, args: (args[0].half().float(),))
    return model


def check(preset: str, tokenizer_dir: Path, out: Path) -> tuple[dict, bool]:
    model = random_model(preset)
    c = model.config
    path = export_gguf(model, c, out / f"{preset}-q8_0.gguf", "Q8_0", tokenizer_dir, BLOCK)
    f32 = f32_copy(path, out / f"{preset}-f32.gguf")
    ours = Transformer(c)
    ours.load_state_dict(dequantized_state_dict(model, c, BITS, BLOCK), strict=False)  # tied head: strict off
    ours.eval()
    tokenizer = load_tokenizer(tokenizer_dir)
    prompt = tokenizer.encode(TEXT)[:PROMPT_LEN]
    with torch.no_grad():
        expected = ours(torch.tensor([prompt]))[0].numpy()
    greedy = generate(ours, [prompt], NEW_TOKENS)[0]
    scale = float(np.abs(expected).max())

    logits32, new32, theirs_tokens = llama_cpp_run(f32, prompt, f32_cache=True)
    logits8, new8, _ = llama_cpp_run(path, prompt, f32_cache=False)
    row = {"preset": preset, "gguf arch": gguf.GGUFReader(path).fields["general.architecture"].contents(),
           "tokenizes alike": theirs_tokens == tokenizer.encode(TEXT),
           "F32 logits rel diff": float(np.abs(logits32 - expected).max()) / scale}
    exact = row["F32 logits rel diff"]
    if c.activation == "gelu_tanh":
        with torch.no_grad():
            rounded = ggml_gelu(ours)(torch.tensor([prompt]))[0].numpy()
        exact = row["F32 rel diff, fp16 GELU"] = float(np.abs(logits32 - rounded).max()) / scale
    row.update({"F32 greedy equal": new32 == greedy,
                "Q8_0 logits rel diff": float(np.abs(logits8 - expected).max()) / scale,
                "Q8_0 greedy agree": f"{sum(a == b for a, b in zip(new8, greedy))}/{NEW_TOKENS}"})
    ok = row["tokenizes alike"] and exact < 1e-4 and row["F32 greedy equal"]
    return row, ok


def check_layout(layout: str, out: Path) -> tuple[dict, bool]:
    """A published layout's tokenizer through a GGUF export into llama.cpp (its vocabulary only): every text
    tokenized alike, a chat rendered with the file's own template tokenized as transformers does, BOS added
    as transformers adds it."""
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    tokenizer_dir = published_tokenizer(out / f"{layout}-tokenizer", layout)
    model = random_model("qwen2-tiny" if layout == "qwen2" else "llama3-tiny")
    path = export_gguf(model, model.config, out / f"{layout}-tokenizer-q8_0.gguf", "Q8_0", tokenizer_dir, BLOCK)
    ours, auto = load_tokenizer(tokenizer_dir), AutoTokenizer.from_pretrained(tokenizer_dir)
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        texts = [*LAYOUT_TEXTS, TEXT]
        alike = sum(llm.tokenize(t.encode(), add_bos=False, special=False) == ours.encode(t) for t in texts)
        template = llm.metadata.get("tokenizer.chat_template")
        chat = auto.apply_chat_template(CHAT, chat_template=template, tokenize=False, add_generation_prompt=True)
        row = {"layout": layout, "tokenizer.ggml.pre": llm.metadata.get("tokenizer.ggml.pre"),
               "texts tokenized alike": f"{alike}/{len(texts)}",
               "chat template kept": template == auto.chat_template,
               "chat tokenized alike": llm.tokenize(chat.encode(), add_bos=False, special=True)
               == auto(chat, add_special_tokens=False)["input_ids"],
               "BOS as transformers": llm.tokenize(TEXT.encode(), add_bos=True) == auto(TEXT)["input_ids"]}
    finally:
        llm.close()
    ok = alike == len(texts) and all(row[k] for k in ("chat template kept", "chat tokenized alike",
                                                        "BOS as transformers"))
    return row, ok


def report(row: dict) -> None:
    print(" | ".join(f"{k}: {v:.2e}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--layouts", default="qwen2,llama3", help="published tokenizer layouts to check ('' for none)")
    parser.add_argument("--out", help="where the GGUF files go (default: a temporary directory)")
    args = parser.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: pip install llama-cpp-python", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="llama_cpp_check-"))
    out.mkdir(parents=True, exist_ok=True)
    lines = default_corpus(out).read_text(encoding="utf-8").splitlines()[:600]
    (out / "text.txt").write_text("\n".join(lines), encoding="utf-8")
    train_sentencepiece([out / "text.txt"], out / "sp" / "tokenizer", TOKENS)
    print(f"llama-cpp-python {llama_cpp.__version__}; files in {out}")
    failed = []
    for preset in filter(None, args.presets.split(",")):
        try:
            row, ok = check(preset, out / "sp", out)
        except Exception as e:  # a file llama.cpp cannot load: report it and go on
            row, ok = {"preset": preset, "error": f"{type(e).__name__}: {e}"}, False
        report(row)
        if not ok:
            failed.append(preset)
    for layout in filter(None, args.layouts.split(",")):
        try:
            row, ok = check_layout(layout, out)
        except Exception as e:
            row, ok = {"layout": layout, "error": f"{type(e).__name__}: {e}"}, False
        report(row)
        if not ok:
            failed.append(f"{layout} tokenizer")
    print("all checks passed" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
