"""Attacks on the hardening of shardsafe's readers, one module per surface attacked.

Each module attacks one promise from several sides with real files: symlinks out of the
checkpoint, FIFOs (``os.mkfifo``), device nodes (``os.mknod``), sparse files, forged
manifests whose checksums are recomputed (``tests/forge.py``), and races in which a
thread keeps swapping a name (``os.replace``) while the code under attack runs. The
swapping threads never ``open`` anything themselves (they link, symlink and rename), so
the audit hook of ``tests/opens.py`` records only what shardsafe opens. Whether anyone
opened a FIFO for reading is probed from a separate process (``fifo_reader_probe``),
which also unblocks such a reader, so a regression fails a test instead of hanging it.

The helpers the modules share (the swapping thread, the FIFO probe, ``run_cli``,
``load_refused``, ``flip_bit``, the constants) are in ``common.py``; the checkpoints
saved once per module (``pristine``, ``copy_of``) and the fixture that gives the global
generators back after each test are in ``conftest.py``.
"""
