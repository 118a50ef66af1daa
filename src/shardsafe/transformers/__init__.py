"""shardsafe for the Hugging Face ``transformers.Trainer``: its optimizer, scheduler and
gradient scaler checkpointed by shardsafe instead of ``torch.save``.

::

    from shardsafe.transformers import ShardsafeTrainer

    trainer = ShardsafeTrainer(model=model, args=TrainingArguments(...), train_dataset=data)
    trainer.train()                                    # checkpoint-N/ as usual, plus
    trainer.train(resume_from_checkpoint=True)         # checkpoint-N/shardsafe/

Needs ``transformers`` (``pip install "shardsafe[transformers]"``).
``docs/transformers.md`` says what is saved where, and what is left to the Trainer.
"""

from __future__ import annotations

from .trainer import SHARDSAFE_DIR, ShardsafeTrainer

__all__ = ["SHARDSAFE_DIR", "ShardsafeTrainer"]
