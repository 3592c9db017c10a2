"""The operator's tools: the `cudahook` command (`cli`), installation and its
journal (`installer`, `journal`, `hookfiles`), runtime registration
(`configure`), checks of the node (`doctor`) and of one container or image
(`check`), `status` with its `chart`,
moving a container to another node (`migrate`), and the `demo`.

May import: anything in cudahook; the simulator only for the demo.
"""
