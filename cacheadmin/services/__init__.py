"""Services: every write of the control plane, named ``<entity>_<action>``."""
