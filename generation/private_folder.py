"""
A folder only this user can write, for files the process reads back as its own.

The compiled steps' cache (step_cache.py) loads a C++ library from disk and runs it: a
library someone else could have written there is their code running as this user. So the
folder must be a real folder (not a symbolic link to somewhere else), owned by this user,
and writable by no one else; a new file in it is created, never opened through a name
someone put there first, and a file is read without following a symbolic link.
"""

import os
import stat
from pathlib import Path


class UnsafeFolder(Exception):
    """The folder fails a check; the message is one line, saying which."""


def private_folder(path):
    """path as a Path, after creating it if missing (mode 0700: this user only) and checking
    it; raises UnsafeFolder if it is a symbolic link or not a folder, belongs to another
    user, or lets the group or others write in it."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(path)  # lstat: the link itself, not where it points
    except OSError as e:
        raise UnsafeFolder(f"{path} cannot be made: {e.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeFolder(f"{path} is a symbolic link")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolder(f"{path} is not a folder")
    if info.st_uid != os.getuid():
        raise UnsafeFolder(f"{path} belongs to another user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeFolder(f"{path} is writable by its group or others (chmod 700 it)")
    return path


def write_new(path, data):
    """Write bytes data to path, a file that must not exist yet (O_EXCL): nothing anyone
    left at that name, a link included, is opened instead."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as f:
        f.write(data)


def open_own(path):
    """path opened for reading as a binary file, if it is a plain file of this user's (not
    a link: O_NOFOLLOW); raises OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    info = os.fstat(fd)  # of the file opened, not of whatever the name points to now
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        raise OSError(f"{path} is not a plain file of this user's")
    return open(fd, "rb")
