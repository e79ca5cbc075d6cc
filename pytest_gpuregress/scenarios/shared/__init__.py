"""What several scenario folders share, below every one of them: a scenario folder imports from here
(and from base.py and lower layers), never from another scenario's folder (docs/architecture.md).

  training_config  the config of a training scenario: shared defaults, the device's, a user's model
  trainer          the one FSDP2 trainer build (a TrainingSpec of callables) and the trainer the loop drives
  replicas         the noise replicas of a training launch (training/noise.py applies them on the ranks)
  safetensors_file the strict, torch-free safetensors reader and writer (formats and checkpoint read with it)
  links            the collective sweep per link: wrong elements by sender and receiver (collectives and consensus)
  links            the collective sweep's wrong elements per sender -> receiver link (collectives, consensus)
  state_pieces     a training state's digests compared piece by piece (checkpoint's resume, the resume cases)
  resume_roles     rank side of a resume from a reference's own checkpoint: its save and continue roles
  resume_plan      session side of it, as one wrapper (with_resume): the resume cases, what a recording stores,
                   the launch that continues, the comparator
  resume_comparison   the verdict on such a resume: the load piece by piece, then the continuation
"""
