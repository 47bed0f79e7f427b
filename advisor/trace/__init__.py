"""Trace: read any trace once (Kineto JSON per rank, Nsight Systems SQLite, a folder, a zip or a stored run)
into the one event table the analyses take."""
