"""`model=hf`: any Hugging Face transformers model, from the Hub or a local `save_pretrained`
directory, pretrained (fine-tuning) or built from its config. Weights load in fp32 whatever dtype
they were saved in: the precision mode decides the rest."""

from __future__ import annotations

import torch
import transformers

from runner import console
from runner.errors import UserError, first_line
from runner.task import Batch, DataModule
from tasks.losses import CrossEntropy, Loss, NextTokenCrossEntropy, make_loss
from tasks.module import ModuleTask

# task: (the transformers Auto class, the data it reads: a DataModule kind, or None for any)
TASKS = {
    "masked_lm": ("AutoModelForMaskedLM", "text"),
    "causal_lm": ("AutoModelForCausalLM", "text"),
    "sequence_classification": ("AutoModelForSequenceClassification", "text_classification"),
    "token_classification": ("AutoModelForTokenClassification", None),
    "image_classification": ("AutoModelForImageClassification", "images"),
}
# model.peft's task_type by model.task: PEFT's model class for it (a classifier's new head then
# trains in full, as `modules_to_save`); masked and image models get PEFT's generic one.
PEFT_TASK_TYPES = {
    "causal_lm": "CAUSAL_LM",
    "sequence_classification": "SEQ_CLS",
    "token_classification": "TOKEN_CLS",
}
DATASETS = {
    "text": "synthetic_text, text_files or hub_text",
    "text_classification": "text_classification",
    "images": "synthetic_images or image_folder",
}


def load_config(
    name_or_path: str, task: str, pretrained: bool, data: DataModule
) -> transformers.PretrainedConfig:
    """The model's config, its head fitted to the dataset's classes (and, when built from the
    config, its input shape to the dataset's images)."""
    try:
        config = transformers.AutoConfig.from_pretrained(name_or_path)
    except Exception as e:  # not a directory, the Hub offline, a malformed config: one line
        raise UserError(
            f"model.name_or_path={name_or_path!r} cannot be loaded: {first_line(e)}"
        ) from None
    if hasattr(data, "num_classes"):
        config.num_labels = data.num_classes
        names = getattr(data, "label_names", None)
        if names:
            config.id2label = dict(enumerate(names))
            config.label2id = {name: i for i, name in enumerate(names)}
    if task == "image_classification":
        for key, value in (("num_channels", data.channels), ("image_size", data.image_size)):
            if not hasattr(config, key):
                continue
            if not pretrained:  # built from the config: shaped to the data
                setattr(config, key, value)
            elif getattr(config, key) != value:
                raise UserError(
                    f"dataset.{key.replace('num_', '')}={value} but model.name_or_path="
                    f"{name_or_path!r} takes {getattr(config, key)}: set dataset."
                    f"{key.replace('num_', '')}={getattr(config, key)}"
                )
    return config


def _check_text_fits(config: transformers.PretrainedConfig, name_or_path: str, data) -> None:
    """The dataset's tokens and blocks fit the model's vocabulary and positions."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and data.vocab_size > vocab:
        raise UserError(
            f"the dataset's tokenizer has {data.vocab_size} tokens, but model.name_or_path="
            f"{name_or_path!r} has a vocabulary of {vocab}: use the model's tokenizer "
            "(dataset.tokenizer, by default the model's own)"
        )
    positions = getattr(config, "max_position_embeddings", getattr(config, "n_positions", None))
    if positions is not None and data.seq_len > positions:
        raise UserError(
            f"dataset.seq_len={data.seq_len} is invalid: model.name_or_path={name_or_path!r} "
            f"takes at most {positions} positions"
        )


def _check_data(task: str, data: DataModule) -> None:
    kind = TASKS[task][1]
    if kind is not None and data.kind != kind:
        raise UserError(
            f"model.task={task} reads {kind} data (dataset={DATASETS[kind]}), but the dataset "
            f"gives {data.kind} data"
        )
    if task == "causal_lm":
        data.use_objective("causal")


class HFModel(ModuleTask):
    """`model.task` picks the head (an `AutoModelFor...` class); `model.loss=auto` computes the
    task's loss from the logits, summed per target (tokens for language models) so that
    accumulation is exact; `model.loss=output` takes the model's own loss instead."""

    keyword_inputs = True

    def __init__(
        self,
        data: DataModule,
        task: str,
        name_or_path: str,
        pretrained: bool = False,
        loss="auto",
        freeze=(),
        gradient_checkpointing: bool = False,
        channels_last: bool | None = None,
        peft=None,
    ):
        if task not in TASKS:
            raise UserError(f"model.task={task!r} is invalid: allowed: {', '.join(TASKS)}")
        _check_data(task, data)
        config = load_config(name_or_path, task, pretrained, data)
        auto = getattr(transformers, TASKS[task][0])
        try:
            if pretrained:
                net = auto.from_pretrained(
                    name_or_path, config=config, dtype=torch.float32, ignore_mismatched_sizes=True
                )
            else:
                net = auto.from_config(config)
        except ValueError as e:  # "Unrecognized configuration class ... for this kind of AutoModel"
            raise UserError(
                f"model.task={task} is not supported by {config.model_type} models "
                f"(model.name_or_path={name_or_path!r}): {first_line(e)}"
            ) from None
        if TASKS[task][1] == "text":
            _check_text_fits(config, name_or_path, data)
        saved = getattr(config, "dtype", None) if pretrained else None
        self.source = {
            "model_source": name_or_path,
            "model_type": config.model_type,
            "hf_task": task,
            "pretrained": pretrained,
            "weights_saved_dtype": str(saved).removeprefix("torch.") if saved else None,
        }
        console.say(
            f"model: {config.model_type} for {task} from {name_or_path}, "
            + (
                f"pretrained weights (saved in {self.source['weights_saved_dtype'] or 'fp32'}, "
                "loaded in fp32)"
                if pretrained
                else "randomly initialised from its config"
            )
        )
        if peft is not None:
            peft = {"task_type": PEFT_TASK_TYPES.get(task), **peft}
        super().__init__(
            data, net, self._loss(task, loss), freeze, gradient_checkpointing, channels_last, peft
        )

    @staticmethod
    def _loss(task: str, loss) -> Loss:
        if loss != "auto":
            return make_loss(loss, class_dim_last=True)
        return NextTokenCrossEntropy() if task == "causal_lm" else CrossEntropy(class_dim_last=True)

    def _checkpoint_blocks(self) -> None:
        if getattr(self.net, "supports_gradient_checkpointing", False):
            self.net.gradient_checkpointing_enable({"use_reentrant": False})
        else:
            super()._checkpoint_blocks()

    def inputs(self, batch: Batch) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        inputs, target = super().inputs(batch)
        if "image" in inputs:
            inputs["pixel_values"] = inputs.pop("image")
        return inputs, target

    def describe(self) -> dict:
        return self.source | super().describe()
