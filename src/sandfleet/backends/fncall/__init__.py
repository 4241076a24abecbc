"""The fncall tier: its backend (backend.py: workers made by a container backend) and the warm
interpreter the service starts in each worker (zygote.py, standard library only). Importing this
package imports neither."""
