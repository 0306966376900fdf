"""The HTTP face of RadixServe (frontend/) and the choice of engine replica (routing/)."""
