"""Data pipeline: tokenizers, Megatron .bin/.idx token files, datasets, sampler, default corpus.

    data.tokenizer  Tokenizer, SentencePieceTokenizer, HFTokenizer, train_sentencepiece, load_tokenizer
    data.indexed    IndexedDatasetBuilder, IndexedDataset, tokenize_to_indexed
    data.datasets   PretrainDataset, ResumableBatchSampler, SFTDataset, PreferenceDataset, collate_*
    data.corpus     default_corpus (stdlib docstrings, no download)
    data.sources    reading text and JSON/JSONL files

Submodules are imported explicitly; this package imports nothing, so worker processes stay light.
"""
