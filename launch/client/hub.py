"""`--model`: a local checkpoint directory, or a Hugging Face Hub id fetched into the Hub's
standard cache.

A Hub id is `org/name` or `org/name@revision`. huggingface_hub does the fetching, so its
environment applies as users know it: HF_HOME / HF_HUB_CACHE (where), HF_HUB_OFFLINE (use
the cache only), HF_TOKEN (gated and private repos), HF_ENDPOINT (a mirror). Only what the
engine reads is downloaded: configs, tokenizer files, chat template, safetensors weights.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

log = logging.getLogger("pagedserve.launch")

# What the engine reads from a checkpoint. Weights only as safetensors: pickled .bin
# files can run code when loaded, and the engine never reads them.
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "*.safetensors.index.json",
]
# Some repos carry a second, original-format copy of the weights beside HF's.
HUB_SKIP = ["original/*", "consolidated*.safetensors"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


class ModelNotFoundError(ValueError):
    """--model names neither a checkpoint directory nor a Hub repo we can fetch."""


def is_hub_id(spec: str) -> bool:
    return _HUB_ID.fullmatch(spec) is not None and ".." not in spec


def resolve_model(spec: str) -> str:
    """The local directory holding the checkpoint `spec` names, fetching a Hub id first.

    An existing directory always wins, so a local `org/name` folder is never shadowed by
    the Hub. ModelNotFoundError carries a one-line reason."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ModelNotFoundError(f"model {spec}: not a directory")
    if not is_hub_id(spec):
        raise ModelNotFoundError(
            f"model {spec}: the directory does not exist, and it is not a Hugging Face Hub "
            "id (org/name or org/name@revision)"
        )
    repo_id, _, revision = spec.partition("@")
    return download(repo_id, revision or None)


def download(repo_id: str, revision: str | None) -> str:
    """The snapshot directory of repo_id at revision, in the Hub cache."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    name = f"{repo_id}@{revision}" if revision else repo_id
    offline = constants.HF_HUB_OFFLINE
    where = constants.HF_HUB_CACHE
    log.info("model %s: from the Hugging Face Hub cache %s%s", name, where, " (offline)" * offline)
    if not offline:
        print(
            f"pagedserve: fetching {name} from the Hugging Face Hub into {where}", file=sys.stderr
        )
    try:
        directory = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIP
        )
    except errors.GatedRepoError:
        raise ModelNotFoundError(
            f"model {name}: the repository is gated; accept its terms on huggingface.co and "
            "set HF_TOKEN"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"model {name}: no such repository on the Hugging Face Hub (or it is private: "
            "set HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise ModelNotFoundError(
            f"model {name}: the repository has no revision {revision}"
        ) from None
    except errors.LocalEntryNotFoundError:
        # Offline (HF_HUB_OFFLINE, or no network) and not in the cache.
        raise ModelNotFoundError(
            f"model {name}: not in the Hugging Face cache {where}, and the Hub cannot be "
            "reached (HF_HUB_OFFLINE is set or there is no network)"
        ) from None
    except (errors.HfHubHTTPError, OSError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(f"model {name}: download failed: {first_line}") from None
    if not (Path(directory) / "config.json").is_file():
        raise ModelNotFoundError(f"model {name}: the repository has no config.json")
    if not any(Path(directory).glob("*.safetensors")):
        raise ModelNotFoundError(
            f"model {name}: the repository has no safetensors weights (pickled .bin "
            "checkpoints are not loaded)"
        )
    return directory
