"""Check our GGUF exports with llama.cpp itself (llama-cpp-python), outside the test suite.

    pip install llama-cpp-python        # builds llama.cpp from source (minutes to half an hour on 2 cores)
    python scripts/check_llama_cpp.py [--presets llama-tiny,qwen2-tiny] [--families gemma2] [--kquants Q6_K]
                                      [--out DIR]

For each tiny preset (GPT-2, LLaMA, Llama 3.1 RoPE scaling, Qwen2, Qwen3, Mistral) and each family of issue 37
(Granite, OLMo 2, SmolLM3, Gemma 2, Gemma 3 text: tiny configs made by transformers' config classes, read by our
loader) a random model over a 400-piece SentencePiece tokenizer is exported as Q8_0 GGUF (block 64), and
llama.cpp:

- loads the file and tokenizes text as our tokenizer does;
- run on the same file with its tensors dequantized to F32 by gguf-py (F32 KV cache), gives the logits
  of our model with the dequantized weights (max |diff| relative to max |logit|) and the same greedy
  continuation: the file holds exactly our weights and llama.cpp computes our model with them (GPT-2,
  Gemma 2 / 3: ggml's GELU goes through an fp16 table, 1e-4 to 4e-4 relative; our model with that rounding
  is compared too);
- run on the Q8_0 file itself: the relative logit difference (llama.cpp's quantized matmuls also quantize
  the activations to 8 bits, so it is about 1%, not 1e-6) and how many greedy tokens agree; beside it, what
  rounding the weights alone does to our forward's logits.

The K-quant mixes (Q4_K_M, Q6_K) run the same way on llama-tiny 256 wide (whole super-blocks; Q8_0 of it as
the baseline), the files quantized from the fp32 weights: the F32 copy against our model with the values the
file holds (read back by gguf-py), and llama.cpp's own K-quant loader and matmuls on the file itself.

Then, for the published byte-level BPE layouts (`published_tokenizer`: Qwen2 / Qwen3 and Llama 3, rebuilt from
their tokenizer.json structure on a small vocabulary), a model exported with each: llama.cpp reads the
pre-tokenizer its GGUF names ('qwen2', 'llama-bpe'), tokenizes texts (contractions, digit runs, whitespace and
newline runs, accents, CJK) as the tokenizers library does, tokenizes a chat rendered with the GGUF's own
`tokenizer.chat_template` as transformers' `apply_chat_template` does, and adds BOS as the tokenizer says.

Exits non-zero when a load, the tokenization, the F32 logits (> 1e-4 relative; GPT-2 and the Gemmas with
fp16 GELU), the F32 greedy tokens or a published layout's tokenization fail.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf.quants import dequantize

from data.corpus import default_corpus
from data.tokenizer import load_tokenizer, train_sentencepiece
from export import dequantized_state_dict, export_gguf
from export.quantized import GGUF_ARCHS, _llama_row_order
from models.config import ModelConfig
from models.generate import generate
from models.hf import config_from_hf, to_hf_state_dict
from models.transformer import Transformer

PRESETS = ("gpt2-tiny", "llama-tiny", "llama3-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-tiny")
TOKENS, VOCAB, BITS, BLOCK = 400, 416, 8, 64
WINDOW = 8  # the Gemmas' window: shorter than the 28 positions a check runs over, so that it bites


def _families() -> dict:
    """The families of issue 37 as transformers' config classes make them (tiny, 256 wide: whole K-quant
    super-blocks), every switch llama.cpp's architecture has a key for away from its default, and what it
    hard-codes as it computes it (SmolLM3 without RoPE on every 4th layer; Gemma's attention scale)."""
    from transformers import Gemma2Config, Gemma3TextConfig, GraniteConfig, Olmo2Config, SmolLM3Config

    size = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    gemma = dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW, **{**size, "num_hidden_layers": 3})
    return {
        "granite": GraniteConfig(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1,
                                 logits_scaling=3.0, attention_bias=True, mlp_bias=True, **size),
        "olmo2": Olmo2Config(**size),
        "smollm3": SmolLM3Config(**{**size, "num_hidden_layers": 4}),
        # the scores' cap low enough to bite; the logits' at the published 30 (one of 3 pins the logits at +-3,
        # and the max |diff| relative to 3 then measures the fp16 GELU table's absolute error against a tenth
        # of the logits' scale: 1.0e-4 there, 3e-4 absolute)
        "gemma2": Gemma2Config(attn_logit_softcapping=5.0, final_logit_softcapping=30.0, **gemma),
        "gemma3": Gemma3TextConfig(sliding_window_pattern=3, final_logit_softcapping=7.0, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **gemma),
    }


FAMILIES = ("granite", "olmo2", "smollm3", "gemma2", "gemma3")
KQUANTS, KQUANT_MODEL = ("Q4_K_M", "Q6_K"), "llama-tiny-256"
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


def random_model(name: str) -> Transformer:
    """A tiny preset, a family of _families() as our loader reads transformers' config, or KQUANT_MODEL.
    Matrices at std 0.2 * sqrt(64 / d_model) (0.2 for the 64-wide presets; at any width a matrix then scales
    the activations alike, where 0.2 at 256 wide makes a model so chaotic that rounding its weights to Q8_0
    moves its logits by 10%; HF's 0.02 makes greedy decoding repeat one token), vectors moved off 0 / 1 so
    that a bias or norm gain put in the wrong place shows."""
    torch.manual_seed(0)
    if name in FAMILIES:
        config = config_from_hf(_families()[name].to_dict(), name)
    elif name == KQUANT_MODEL:  # llama-tiny 256 wide: its matrices whole K-quant super-blocks
        config = ModelConfig.from_preset("llama-tiny", vocab_size=VOCAB, d_model=256, d_ff=512)
    else:
        extra = {"d_ff": 128} if name == "llama-tiny" else {}  # its 176 is no multiple of GGUF's 32-element blocks
        config = ModelConfig.from_preset(name, vocab_size=VOCAB, **extra)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 * (64 / config.d_model) ** 0.5)
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
    """ggml computes GELU through an fp16 table (GGML_GELU_FP16): its input and its output are fp16 values
    (below -10 it gives 0, from 10 on its input). Rounds them so in `model` (GPT-2's MLP: hooks around the
    activation; a GeGLU's gate: its MLP's forward), to tell that rounding from a wrong weight."""
    for block in model.blocks:
        mlp = block.mlp
        if mlp.activation == "swiglu":
            def forward(x, mlp=mlp):
                g = mlp.gate_proj(x)
                table = F.gelu(g.half().float(), approximate="tanh").half().float()
                gate = torch.where(g <= -10, torch.zeros_like(g), torch.where(g >= 10, g, table))
                return mlp.down_proj(gate * mlp.up_proj(x))
            mlp.forward = forward
        else:
            mlp.up_proj.register_forward_hook(lambda module, args, out: out.half().float())
            mlp.down_proj.register_forward_pre_hook(lambda module, args: (args[0].half().float(),))
    return model


def file_weights(path: Path, model: Transformer) -> dict[str, torch.Tensor]:
    """The weights a GGUF file of a LLaMA `model` holds, by our names: each tensor dequantized by gguf-py,
    llama.cpp's q/k row order undone."""
    c = model.config
    names = gguf.get_tensor_name_map(GGUF_ARCHS[c.arch], c.n_layer)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    out = {}
    for name, p in model.named_parameters():  # a tied head once, as the token embedding
        (hf_name,) = to_hf_state_dict({name: p}, c)
        t = tensors[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))]
        values = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).reshape(p.shape)
        heads = {"attn.q_proj.weight": c.n_head, "attn.k_proj.weight": c.n_kv_head}
        n_head = next((h for key, h in heads.items() if name.endswith(key)), None)
        out[name] = values[torch.argsort(_llama_row_order(p.shape[0], n_head))] if n_head else values
    return out


def check(name: str, tokenizer_dir: Path, out: Path, qtype: str = "Q8_0") -> tuple[dict, bool]:
    """One model exported as `qtype` (Q8_0 block 64, or a K-quant mix quantized from the fp32 weights): llama.cpp
    on its F32-dequantized copy against our model with the weights the file holds, and on the file itself."""
    model = random_model(name)
    c = model.config
    path = export_gguf(model, c, out / f"{name}-{qtype.lower()}.gguf", qtype, tokenizer_dir, BLOCK)
    f32 = f32_copy(path, out / f"{name}-{qtype.lower()}-f32.gguf")
    ours = Transformer(c)
    held = dequantized_state_dict(model, c, BITS, BLOCK) if qtype == "Q8_0" else file_weights(path, model)
    ours.load_state_dict(held, strict=False)  # tied head: strict off
    ours.eval()
    tokenizer = load_tokenizer(tokenizer_dir)
    prompt = tokenizer.encode(TEXT)[:PROMPT_LEN]
    with torch.no_grad():
        expected = ours(torch.tensor([prompt]))[0].numpy()
        unquantized = model(torch.tensor([prompt]))[0].numpy()
    greedy = generate(ours, [prompt], NEW_TOKENS)[0]
    scale = float(np.abs(expected).max())

    logits32, new32, theirs_tokens = llama_cpp_run(f32, prompt, f32_cache=True)
    logits_q, new_q, _ = llama_cpp_run(path, prompt, f32_cache=False)
    row = {"model": name, "type": qtype, "gguf arch": gguf.GGUFReader(path).fields["general.architecture"].contents(),
           "tokenizes alike": theirs_tokens == tokenizer.encode(TEXT),
           "F32 logits rel diff": float(np.abs(logits32 - expected).max()) / scale}
    exact = row["F32 logits rel diff"]
    if c.activation == "gelu_tanh" or c.gate_activation == "gelu_tanh":
        with torch.no_grad():
            rounded = ggml_gelu(ours)(torch.tensor([prompt]))[0].numpy()
        exact = row["F32 rel diff, fp16 GELU"] = float(np.abs(logits32 - rounded).max()) / scale
    row.update({"F32 greedy equal": new32 == greedy,
                # what rounding the weights alone does to this model's logits (our forward), for scale
                f"{qtype} weights vs fp32 rel diff": float(np.abs(expected - unquantized).max()) / scale,
                f"{qtype} logits rel diff": float(np.abs(logits_q - expected).max()) / scale,
                f"{qtype} greedy agree": f"{sum(a == b for a, b in zip(new_q, greedy))}/{NEW_TOKENS}"})
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
    parser.add_argument("--families", default=",".join(FAMILIES), help="the families of issue 37 ('' for none)")
    parser.add_argument("--kquants", default=",".join(KQUANTS),
                        help=f"K-quant mixes run on {KQUANT_MODEL} ('' for none)")
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
    runs = [(name, "Q8_0") for name in filter(None, [*args.presets.split(","), *args.families.split(",")])]
    kquants = list(filter(None, args.kquants.split(",")))
    runs += [(KQUANT_MODEL, mix) for mix in ["Q8_0", *kquants] if kquants]  # Q8_0: the same model's baseline
    for name, qtype in runs:
        try:
            row, ok = check(name, out / "sp", out, qtype)
        except Exception as e:  # a file llama.cpp cannot load: report it and go on
            row, ok = {"model": name, "type": qtype, "error": f"{type(e).__name__}: {e}"}, False
        report(row)
        if not ok:
            failed.append(f"{name} {qtype}")
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
