"""The TensorFlow coordinator in the notebook's kernel: ParameterServerStrategy's cluster
resolver with this kernel as chief (``tfps``) and the coordinator of its workers
(``tfcoord``). TensorFlow is imported only when they are called."""
