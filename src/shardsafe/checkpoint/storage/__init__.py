"""Bytes in and out of one checkpoint directory, with no notion of tensors.

``protocol`` declares what the engine needs (:class:`~.protocol.Storage` and its
capabilities); ``local`` (a directory on a filesystem, over ``files``, ``dir_sync`` and
``direct_writes``) and ``object_storage`` (an object-store prefix through fsspec, over
``object_reader``) provide it; ``locations`` picks one for a path or URL. Around a
directory: ``target_directory`` (the directory a save writes, with ``leftovers``: what it
may clear), ``removal`` (deleting a checkpoint safely), ``placement`` (swapping a staged
checkpoint into a taken name), ``lock`` (one writer per root, over ``lock_backends`` and
``lock_owner``) and ``spool`` (a local copy of what a load downloads).

Nothing outside this package checks which storage it holds (a test pins this): what
differs between stores is declared as a capability in ``protocol``.
"""
