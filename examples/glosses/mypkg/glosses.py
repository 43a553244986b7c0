"""Part of speech of a WordNet definition: a transformers model, the Hugging Face way."""
import random
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
)

from elastic_runner.config import Config
from elastic_runner.config import ModelConfig as BaseModelConfig
from elastic_runner.tasks.base import TaskBundle, job_artifact, weight_decay_groups

POS = ["noun", "verb", "adj", "adv"]  # WordNet's data files (Debian package wordnet-base)


class ModelConfig(BaseModelConfig):
    hidden_size: int = 64
    layers: int = 2


def glosses(per_class: int = 3000) -> list[tuple[str, int]]:
    """(definition, part of speech) of the first synsets of each WordNet data file."""
    out = []
    for label, pos in enumerate(POS):
        lines = Path(f"/usr/share/wordnet/data.{pos}").read_text().splitlines()
        defs = [ln.split(" | ", 1)[1].split(";")[0] for ln in lines if not ln.startswith(" ")]
        out += [(text, label) for text in defs[:per_class]]
    return out


def train_tokenizer(texts: list[str]) -> str:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(
        vocab_size=2000, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.BertProcessing(
        ("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]")))
    return tok.to_str()


def accuracy(outputs, batch) -> dict[str, tuple[float, float]]:
    n = float(len(batch["labels"]))
    correct = (outputs.logits.argmax(-1) == batch["labels"]).sum().item()
    return {"loss": (outputs.loss.item() * n, n), "accuracy": (correct, n)}


def build(cfg: Config) -> TaskBundle:
    data = glosses()
    random.Random(cfg.seed).shuffle(data)  # the same order on every rank and every restart
    # trained once per job, then the same on every rank and restart (job_artifact): tokenizers'
    # trainers break ties in hash order (huggingface/tokenizers#1794)
    trained = job_artifact(cfg, "tokenizer.json",
                           lambda: train_tokenizer([text for text, _ in data[:10000]]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(trained),
                                        unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                        sep_token="[SEP]")
    samples = [{**tokenizer(text, truncation=True, max_length=32), "labels": label}
               for text, label in data]
    m = cfg.model
    model = BertForSequenceClassification(BertConfig(
        vocab_size=len(tokenizer), hidden_size=m.hidden_size, num_hidden_layers=m.layers,
        num_attention_heads=2, intermediate_size=4 * m.hidden_size, max_position_embeddings=32,
        num_labels=len(POS), id2label=dict(enumerate(POS))))
    return TaskBundle(model=model, train=samples[:10000], val=samples[10000:11000],
                      test=samples[11000:], metrics_fn=accuracy, tokenizer=tokenizer,
                      collate_fn=DataCollatorWithPadding(tokenizer),
                      param_groups=weight_decay_groups)
