"""Whether a study folder may be trusted by `--resume`, which unpickles what it holds (Tune's
tuner.pkl and experiment state, the searchers' state): whoever can write the folder runs code as the
user who resumes it. The weights-only loading of checkpoints (trial/storage.py) does not change that.

A local folder is refused when it, or anything in it or named by a link in it, can be changed by another user (owned by one,
or writable by all users or by a group with another member), or when the storage folder holding it
lets others rename it away (writable by them and not sticky, as /tmp is). A bucket is not checked: its
policy is its owner's and is not readable with a study's credentials (docs/records.md, "Trusted storage").
"""

from __future__ import annotations

import os
import shlex

from trial import storage as store


def check_resume_folder(study_dir: str) -> str | None:
    """Why `--resume` may not trust `study_dir` (one line naming the file), or None; a bucket: None."""
    if store.is_uri(study_dir):
        return None
    parent = os.path.dirname(study_dir.rstrip(os.sep))
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        return None
    if not st.st_mode & 0o1000 and _writable_by_others(st):  # 01000: the sticky bit, as /tmp has
        return _untrusted(parent, st, study_dir)
    for path in [study_dir, *_inside(study_dir)]:
        try:
            st = os.lstat(path)
            target = os.stat(path) if os.path.islink(path) else None  # what a link names is what is read
        except FileNotFoundError:  # removed meanwhile, or a link to nothing
            continue
        for seen in (st, target):
            if seen is not None and _writable_by_others(seen):
                return _untrusted(path if seen is st else f"{path} (a link to {os.path.realpath(path)})",
                                  seen, study_dir)
    return None


def _inside(folder: str) -> list[str]:
    """Every path under `folder`, following links to folders (each real folder once: a link loop ends)."""
    found, seen, todo = [], {os.path.realpath(folder)}, [folder]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for entry in entries:
            found.append(entry.path)
            real = os.path.realpath(entry.path)
            if entry.is_dir(follow_symlinks=True) and real not in seen:
                seen.add(real)
                todo.append(entry.path)
    return found


def _writable_by_others(st: os.stat_result) -> bool:
    """Whether someone but this user (and root) can change the file: its owner is another user, or its
    mode lets all users, or a group with another member, write it (a link's own mode means nothing)."""
    import stat

    if st.st_uid not in (os.geteuid(), 0):
        return True
    if stat.S_ISLNK(st.st_mode):
        return False
    return bool(st.st_mode & 0o002) or bool(st.st_mode & 0o020) and _group_has_others(st.st_gid, st.st_uid)


def _group_has_others(gid: int, owner: int) -> bool:
    import grp
    import pwd

    try:
        group = grp.getgrgid(gid)
    except KeyError:  # a group this machine does not know: who is in it cannot be told
        return True
    try:
        name = pwd.getpwuid(owner).pw_name
    except KeyError:
        name = None
    return any(m != name for m in group.gr_mem) or \
        any(u.pw_gid == gid and u.pw_uid != owner for u in pwd.getpwall())


def _untrusted(path: str, st: os.stat_result, study_dir: str) -> str:
    who = f"owned by uid {st.st_uid}" if st.st_uid not in (os.geteuid(), 0) else f"mode {st.st_mode & 0o7777:04o}"
    return (f"--resume: {path} can be changed by other users ({who}): a resume unpickles what {study_dir} "
            "holds, so whoever can write there runs code as you; nothing was read. Make it yours and writable "
            f"by you only (chmod -R go-w {shlex.quote(study_dir)}), then resume")
