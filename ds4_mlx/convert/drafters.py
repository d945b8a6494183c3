"""Drafter GGUFs: ds4's DSpark support file and the one-block MTP file, read with the converter's rules.

- DSpark (`DeepSeek-V4-Flash-DSpark-support*.gguf`): `general.architecture = deepseek4-dspark`, keys
  `dspark.block_size`, `dspark.markov_rank`, `dspark.noise_token_id`, `dspark.target_layer_ids`,
  `dspark.stage_count` (some ds4 builds: `deepseek4.dspark.*`), tensors `mtp.{s}.*` (or `dspark.{s}.*`): a
  decoder block's names per stage, `main_proj` / `main_norm` on stage 0, and on the last stage `norm`,
  `hc_head_{fn,base,scale}`, `markov_head.markov_w1` / `markov_w2`, `confidence_head.proj`.
- MTP (`DeepSeek-V4-Flash-MTP-*.gguf`): tensors `mtp.0.*`: `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm`,
  `hc_head_{fn,base,scale}` and a decoder block's names.

A drafter has no embedding, head or shape keys of its own: it takes the target's (`models.dspark`,
`models.mtp`), so loading checks its tensors against the target's shapes.
"""

import re

from gguf import GGUFReader

from ds4_mlx.convert.gguf import SUPPORTED, GGUFModel, TensorPlan, _one_line
from ds4_mlx.models import gguf_blocks
from ds4_mlx.models.gguf_names import LAYER_NAMES
from ds4_mlx.models.dspark import DSparkArgs

DSPARK_ARCH = "deepseek4-dspark"
DSPARK_KEYS = ("block_size", "markov_rank", "noise_token_id", "target_layer_ids", "stage_count")
_STAGE = re.compile(r"(?:mtp|dspark)\.(\d+)\.(.+)")
_DSPARK_EXTRA = {
    "main_proj": "main_proj.weight", "main_norm": "main_norm.weight", "norm": "norm.weight",
    "hc_head_fn": "hc_head.fn", "hc_head_base": "hc_head.base", "hc_head_scale": "hc_head.scale",
}
_DSPARK_TOP = {"markov_head.markov_w1": "markov_head.markov_w1.weight",
               "markov_head.markov_w2": "markov_head.markov_w2.weight"}
_MTP_EXTRA = {
    "e_proj": "e_proj.weight", "h_proj": "h_proj.weight", "enorm": "enorm.weight", "hnorm": "hnorm.weight",
    "norm": "norm.weight", "hc_head_fn": "hc_head.fn", "hc_head_base": "hc_head.base",
    "hc_head_scale": "hc_head.scale",
}


def drafter_name(gguf_name, kind):
    """The drafter parameter path of a GGUF tensor name, or None if unknown."""
    m = _STAGE.fullmatch(gguf_name)
    if not m:
        return None
    stage, rest = int(m.group(1)), m.group(2)
    suffix = re.search(r"\.(weight|bias)$", rest)
    base = rest[: suffix.start()] if suffix else rest
    if kind == "dspark":
        if base == "confidence_head.proj":
            return f"confidence_head.proj.{suffix.group(1) if suffix else 'weight'}"
        if base in _DSPARK_TOP:
            return _DSPARK_TOP[base]
        sub = LAYER_NAMES.get(base) or _DSPARK_EXTRA.get(base)
        return f"stages.{stage}.{sub}" if sub else None
    if stage != 0:
        return None
    if base in _MTP_EXTRA:
        return _MTP_EXTRA[base]
    sub = LAYER_NAMES.get(base)
    return f"block.{sub}" if sub else None


class DrafterConfig:
    """What a converted drafter folder's config.json holds (`to_dict`)."""

    def __init__(self, kind, dspark=None):
        self.kind, self.dspark = kind, dspark

    def to_dict(self):
        d = {"drafter": self.kind}
        if self.dspark is not None:
            d["dspark"] = self.dspark.to_dict()
        return d


def drafter_kind(tensor_names, metadata):
    """"dspark", "mtp", or None (not a drafter file)."""
    if metadata.get("general.architecture") == DSPARK_ARCH:
        return "dspark"
    names = set(tensor_names)
    if any(n.startswith("blk.") for n in names):
        return None
    if any(re.fullmatch(r"(mtp|dspark)\.\d+\.main_proj(\.weight)?", n) for n in names):
        return "dspark"
    if any(re.fullmatch(r"mtp\.0\.e_proj(\.weight)?", n) for n in names):
        return "mtp"
    return None


def dspark_args(metadata, path):
    d = {}
    for key in DSPARK_KEYS:
        for prefix in ("dspark.", "deepseek4.dspark."):
            if prefix + key in metadata:
                d[key] = metadata[prefix + key]
    if "target_layer_ids" not in d:
        raise ValueError(f"{path}: missing metadata key dspark.target_layer_ids")
    try:
        d["target_layer_ids"] = [int(i) for i in d["target_layer_ids"]]
        return DSparkArgs(**{k: v if k == "target_layer_ids" else int(v) for k, v in d.items()})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad dspark metadata ({_one_line(e)})") from None


class DrafterGGUF:
    """A drafter GGUF, validated (one-line ValueErrors naming the file and the problem); `tensors` are
    the converter's `TensorPlan`s, so `iter_weights` and `ds4-mlx convert` read it as they read a model.
    `args` is the folder config (`DrafterConfig`)."""

    iter_weights = GGUFModel.iter_weights

    def __init__(self, path, *, experts=None):
        from ds4_mlx.convert.requant import affine_format

        self.path = str(path)
        self.files = [self.path]
        try:
            reader = GGUFReader(self.path, "r")
            self.metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        except Exception as e:  # gguf raises many types on corrupt or truncated input
            raise ValueError(f"{path}: not a readable GGUF file ({_one_line(e)})") from None
        self.kind = drafter_kind([t.name for t in reader.tensors], self.metadata)
        if self.kind is None:
            raise ValueError(f"{path}: not a DSpark or MTP drafter file (no mtp.N.* tensors)")
        self.dspark = dspark_args(self.metadata, path) if self.kind == "dspark" else None
        self.args = DrafterConfig(self.kind, self.dspark)
        native = experts != "affine" and gguf_blocks.native_available()
        self.tensors = []
        for t in reader.tensors:
            name = drafter_name(t.name, self.kind)
            if name is None:
                raise ValueError(f"{path}: unknown tensor {t.name} in a {self.kind} drafter")
            if t.tensor_type not in SUPPORTED:
                raise ValueError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}")
            self.tensors.append(TensorPlan(t, name, self.path, lambda q: affine_format(q, None, None), native))
        if self.kind == "dspark":
            stages = {int(_STAGE.fullmatch(t.name).group(1)) for t in reader.tensors}
            if stages != set(range(self.dspark.stage_count)):
                raise ValueError(f"{path}: tensors of stages {sorted(stages)}, but dspark.stage_count is "
                                 f"{self.dspark.stage_count}")
        self.total_bytes = sum(p.nbytes for p in self.tensors)
        self.notice = None


def is_drafter_gguf(path):
    """Whether `path` is a drafter GGUF (cheap: reads the header)."""
    try:
        reader = GGUFReader(str(path), "r")
        arch = reader.fields.get("general.architecture")
        metadata = {"general.architecture": arch.contents()} if arch is not None else {}
        return drafter_kind([t.name for t in reader.tensors], metadata) is not None
    except Exception:  # noqa: BLE001 - not ours to judge here: the model reader says what is wrong
        return False
