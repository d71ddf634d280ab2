"""`kvctl top`: the operators' live view. ``model`` and ``sources`` are plain Python; only
``app`` and the screens import Textual, and only when the view is opened."""
