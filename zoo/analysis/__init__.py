"""Analysis of trained models (issue 7): routing statistics by modality (`routing`), their figures (`plots`)
and the `zoo analyze` command (`command`). Plain PyTorch; the training-time logger is
`zoo.tasks.routing_monitor.RoutingMonitor`."""

from zoo.analysis.routing import (
    RoutingCounts,
    RoutingRecorder,
    iou,
    normalised_entropy,
    top_experts,
)

__all__ = ["RoutingCounts", "RoutingRecorder", "iou", "normalised_entropy", "top_experts"]
