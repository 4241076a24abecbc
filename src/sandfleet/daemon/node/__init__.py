"""The node's sandbox concerns: the table of sandboxes and everything done to them."""
