"""Moving bytes: carrying out a plan against a storage.

Save side: ``staging`` (copies of the state taken for a background save), ``chunk_bytes``
(a rank's chunks as byte ranges), ``writing`` (a rank's own files) and the consolidated
layout's ``consolidate_sender``/``consolidate_receiver``, all through ``written`` (one
file opened, finished and reported) and ``safetensors_io`` (the streaming writer, with
block CRCs). Load side: ``reader`` (checked byte ranges of a checkpoint's files),
``in_place`` (bytes straight into the live tensors) and ``arriving`` (a file's bytes
checked as they arrive from a peer, before they are written).
"""
