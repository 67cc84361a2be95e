"""Moving folders to and from the Hub: a local folder or a hub id in, a local folder out; a saved folder up.

Only the files a zoo folder has (`layout.FOLDER_FILES`) are downloaded or uploaded. A push keeps the README
already on the Hub (a card someone edited there is theirs) unless `overwrite_card` says otherwise, and deletes
the weight files on the Hub it does not replace (`layout.WEIGHT_FILES`), so that a sharded push never leaves
an older `model.safetensors` beside its index (or a shorter set of shards beside stale ones).
"""

from __future__ import annotations

from pathlib import Path

from zoo.publishing.layout import CARD_NAME, FOLDER_FILES, WEIGHT_FILES


def split_revision(ref: str) -> tuple[str, str | None]:
    """`"user/name@rev"` -> `("user/name", "rev")`; a plain repo id has no revision."""
    repo_id, at, revision = ref.partition("@")
    return repo_id, (revision if at else None)


def resolve(
    path_or_repo_id: str | Path,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | None = None,
    local_files_only: bool = False,
    endpoint: str | None = None,
) -> Path:
    """A local directory as is; a hub repo id downloaded (only the files a zoo folder uses)."""
    path = Path(path_or_repo_id)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; from_pretrained takes a directory or a hub repo id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(
            snapshot_download(
                str(path_or_repo_id),
                revision=revision,
                cache_dir=cache_dir,
                token=token,
                local_files_only=local_files_only,
                allow_patterns=list(FOLDER_FILES),
                endpoint=endpoint,
            )
        )
    except (HFValidationError, OSError) as err:  # hub errors are OSErrors (HTTP, offline, not found)
        raise FileNotFoundError(
            f"{path_or_repo_id}: no such local folder (looked in {path.resolve()}), and fetching it as a hub "
            f"repo id failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from err


def keeps_hub_card(card_on_hub: bool, overwrite_card: bool) -> bool:
    """Whether a push leaves the Hub's README alone: when there is one and nobody asked to replace it."""
    return card_on_hub and not overwrite_card


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str = "Upload zoo model",
    endpoint: str | None = None,
    overwrite_card: bool = False,
) -> str:
    """`create_repo` + `upload_folder` of a saved folder's files; returns the commit URL. The README goes up
    only when the repo has none yet, or with `overwrite_card`; weight files already on the Hub that the folder
    does not have are deleted in the same commit."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    card_on_hub = api.file_exists(repo_id, CARD_NAME, revision=revision)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        revision=revision,
        commit_message=commit_message,
        allow_patterns=list(FOLDER_FILES),
        ignore_patterns=[CARD_NAME] if keeps_hub_card(card_on_hub, overwrite_card) else None,
        delete_patterns=list(WEIGHT_FILES),  # those the folder uploads are replaced, not deleted
    )
    return str(getattr(commit, "commit_url", commit))
