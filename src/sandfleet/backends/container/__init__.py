"""The container tier: its backend (backend.py, built up from preparation.py, sandboxes.py and
snapshots.py) and the OCI runtime bundle it writes for crun or runc (bundle.py). Importing this
package imports none of them."""
