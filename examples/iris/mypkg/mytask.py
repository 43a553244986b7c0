import torch
import torch.nn.functional as F
from sklearn.datasets import load_iris
from torch import nn
from torch.utils.data import TensorDataset

from elastic_runner.config import Config
from elastic_runner.config import ModelConfig as BaseModelConfig
from elastic_runner.tasks.base import TaskBundle


class ModelConfig(BaseModelConfig):
    hidden: int = 32


def metrics(logits: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[float, float]]:
    n = float(len(target))
    return {"loss": (F.cross_entropy(logits, target, reduction="sum").item(), n),
            "accuracy": ((logits.argmax(1) == target).sum().item(), n)}


def build(cfg: Config) -> TaskBundle:
    x, y = load_iris(return_X_y=True)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(cfg.seed))
    x, y = torch.tensor(x, dtype=torch.float32)[order], torch.tensor(y)[order]
    mean, std = x[:100].mean(0), x[:100].std(0)  # normalise with train statistics
    x = (x - mean) / std
    split = lambda a, b: TensorDataset(x[a:b], y[a:b])  # noqa: E731
    model = nn.Sequential(nn.Linear(4, cfg.model.hidden), nn.ReLU(),
                          nn.Linear(cfg.model.hidden, 3))
    return TaskBundle(model=model, train=split(0, 100), val=split(100, 125),
                      test=split(125, 150), loss_fn=F.cross_entropy, metrics_fn=metrics,
                      artifacts={"mean": mean.tolist(), "std": std.tolist()})
