"""What a Chatchat 0.3.x deployment is, read from outside it: a root's settings and paths, its commands run in
a child process, the models this process serves and the switches that turn the plugin's patches off.

Imported from every interpreter's start-up hook: nothing here may import torch or Chatchat at module level."""
