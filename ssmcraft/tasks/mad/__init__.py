"""MAD's six synthetic tasks (Poli et al., 2024, "Mechanistic Design and Scaling of Hybrid
Architectures"), their difficulty levels and score (``levels``)."""
from __future__ import annotations

from ssmcraft.tasks.mad.copying import CompressionTask, SelectiveCopyingTask
from ssmcraft.tasks.mad.levels import MAD_TASKS, levels, mad_score, task_score
from ssmcraft.tasks.mad.memorization import MemorizationTask
from ssmcraft.tasks.mad.recall import FuzzyRecallTask, InContextRecallTask, NoisyRecallTask

TASK_CLASSES = (InContextRecallTask, FuzzyRecallTask, NoisyRecallTask, SelectiveCopyingTask, CompressionTask,
                MemorizationTask)

__all__ = ["TASK_CLASSES", "MAD_TASKS", "levels", "mad_score", "task_score", "InContextRecallTask",
           "FuzzyRecallTask", "NoisyRecallTask", "SelectiveCopyingTask", "CompressionTask", "MemorizationTask"]
